"""Where this training process runs: the communicator or simulated world and the device
(:class:`Runtime`), and the data pipeline every rank builds at once."""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradzip.comm import init_communicator
from gradzip.comm.sim import SimWorld, set_work_scale
from gradzip.data import PretrainData
from gradzip.data.generated import GeneratedData, is_generated
from gradzip.engine.modes import check_machine
from gradzip.host import HostMonitor, busy_elsewhere, choose_threads, usable_cores
from gradzip.models import bert_config
from gradzip.training.config import TrainConfig, load_toml

LAUNCH_MARKER = "GRADZIP_TRAIN_CHILD"  # set in processes that `gradzip train` spawned itself


# ---------------------------------------------------------------------- communicator + device
@dataclass
class Runtime:
    """Where this process stands: ``sim`` hosts every worker (rank 0 of 1 process); real backends
    are one rank per process."""

    device: torch.device
    rank: int
    num_workers: int  # workers in the run: sim: N virtual; real: the world size
    world: Any = None  # SimWorld (sim)
    comm: Any = None  # Communicator (real backends)
    threads: int = 0  # torch's intra-op threads (0: not chosen here)
    threads_reason: str = ""
    threads_requested: int = 0  # what this invocation alone would have chosen (OMP_NUM_THREADS, free cores)
    threads_warning: str = ""  # rank 0: OMP_NUM_THREADS overridden by the run's count
    threads_before: int = 0  # torch's thread count before this run chose its own
    work_scale: float = 1.0  # sim: the threads' CPU overhead its work clock divides out (calibrate_clock)
    monitor: HostMonitor | None = None  # contention, step by step

    @property
    def work_time(self) -> Any:
        """The clock of local work: wall time, or sim's CPU time (``Communicator.work_time``)."""
        return (self.world.comms[0] if self.world is not None else self.comm).work_time

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def target(self) -> Any:
        """What :func:`gradzip.engine.attach` takes: the SimWorld, or this rank's communicator."""
        return self.world if self.world is not None else self.comm

    @property
    def control(self) -> Any:
        """Real backends: the communicator's control channel (:meth:`gradzip.comm.base.Communicator.
        control`, made in :func:`create_runtime`), which the loop's own collectives below use, so that
        they never queue behind an exchange in flight (an overlapped outer sync's); None for sim."""
        if self.comm is None or self.comm.world_size == 1:
            return self.comm
        return self.comm.control()

    def barrier(self) -> None:
        if self.comm is not None:
            with uncounted(self.control):
                self.control.barrier()

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        """Sum of ``values`` over real ranks (identity for sim), on the control channel. Not counted
        in the byte stats: logging is not part of the measured exchange."""
        if self.comm is None or self.comm.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        with uncounted(self.control):
            self.control.allreduce(t, "sum")
        return t.tolist()

    def broadcast_str(self, text: str | None) -> str:
        """Rank 0's ``text`` on every rank (e.g. the auto-generated --out directory)."""
        if self.comm is None or self.comm.world_size == 1:
            return text or ""
        buf = torch.zeros(1024, dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            raw = (text or "").encode()[:1024]
            buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        with uncounted(self.control):
            self.control.broadcast(buf, 0)
        return bytes(buf.cpu().tolist()).rstrip(b"\0").decode()

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
        if self.world is not None:
            set_work_scale(1.0)
        if self.threads_before:  # train() called from Python leaves torch's threads as it found them
            torch.set_num_threads(self.threads_before)

    def calibrate_clock(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], autocast: Any) -> float:
        """sim on more than one thread: the CPU time of a forward and backward of ``batch`` on this
        run's threads over its CPU time on one thread, measured on a copy of ``model`` (median of 2,
        after a warm-up; the RNG streams are left as they were). sim's work clock divides by it
        (:func:`gradzip.comm.sim.set_work_scale`), so that modelled times are one-thread CPU times
        whether torch got one thread (a busy machine) or all cores (a quiet one). Returns the factor."""
        if self.world is None or self.threads <= 1:
            return 1.0
        copy_ = copy.deepcopy(model)
        ratios = []
        with torch.random.fork_rng(devices=[]):
            for rep in range(3):
                cpu = {}
                for t in (1, self.threads):
                    torch.set_num_threads(t)
                    copy_.zero_grad(set_to_none=True)
                    t0 = time.process_time()
                    with autocast():
                        loss = copy_(**batch).loss
                    loss.backward()
                    cpu[t] = time.process_time() - t0
                if rep:  # the first round warms the caches up
                    ratios.append(cpu[self.threads] / max(cpu[1], 1e-9))
        torch.set_num_threads(self.threads)
        factor = min(max(1.0, statistics.median(ratios)), float(self.threads))
        set_work_scale(factor)
        self.work_scale = factor
        return factor


@contextlib.contextmanager
def uncounted(comm: Any) -> Iterator[None]:
    """Run bookkeeping collectives without changing ``comm.stats`` (restored in place, since the
    engine may hold a reference to the stats object)."""
    saved = copy.deepcopy(comm.stats)
    try:
        yield
    finally:
        st = comm.stats
        for name in ("bytes_sent", "bytes_recv", "seconds", "calls", "intra_bytes_sent"):
            setattr(st, name, getattr(saved, name))
        st.by_op.clear()
        st.by_op.update(saved.by_op)


def create_runtime(cfg: TrainConfig) -> Runtime:
    """sim: a SimWorld of ``cfg.workers``. Real backends: this rank's communicator, from the
    launcher's environment (world size from there, not from ``--workers``). Torch gets the run's
    intra-op thread count: ``cfg.threads``, else (``--resume``) the one the run's ``config.toml``
    recorded, else what :func:`gradzip.host.choose_threads` gives (``OMP_NUM_THREADS``, or the free
    cores), since the thread count changes how sums round and a resumed run must compute as it did.
    ``threads_requested`` keeps what this invocation alone would have chosen. Rank 0 warns in one
    line when other processes already keep cores busy; ``threads_warning`` holds the line for an
    explicit ``OMP_NUM_THREADS`` that differs from the run's count (the loop prints it once ``--out``
    is accepted). A :class:`HostMonitor` watches for contention. First, what the sync mode needs of
    this machine (:func:`gradzip.engine.modes.check_machine`), one line otherwise."""
    rt = _create_runtime(cfg)
    omp = os.environ.get("OMP_NUM_THREADS", "").strip().isdigit()
    busy = 0.0 if omp else busy_elsewhere()
    rt.threads_requested, rt.threads_reason = choose_threads(busy)
    recorded = cfg.threads or saved_threads(cfg)
    rt.threads = recorded or rt.threads_requested
    if recorded:
        rt.threads_reason = "the run's setting `threads` (kept by --resume)"
    if rt.is_main and omp and rt.threads != rt.threads_requested:  # printed once --out is accepted
        rt.threads_warning = (f"gradzip train: warning: OMP_NUM_THREADS={rt.threads_requested} differs from this "
                              f"run's {rt.threads} threads (its setting `threads`, which --resume keeps); torch "
                              f"uses {rt.threads}, so that the sums round as before (start a new --out to compute on "
                              f"{rt.threads_requested})")
    rt.threads_before = torch.get_num_threads()
    torch.set_num_threads(rt.threads)
    rt.monitor = HostMonitor(rt.threads)
    if rt.is_main and busy >= 0.5:
        clock = ("sim's modelled times count CPU time, so they stay comparable" if rt.world is not None
                 else "measured times may be inflated")
        sys.stderr.write(f"gradzip train: warning: other processes keep {busy:.1f} of {usable_cores()} cores busy; "
                         f"torch uses {rt.threads} thread{'s' if rt.threads != 1 else ''} ({clock})\n")
    return rt


def saved_threads(cfg: TrainConfig) -> int | None:
    """With ``--resume``: the thread count recorded in ``--out``'s ``config.toml`` (None: no run
    there, or one from before counts were recorded)."""
    saved = Path(cfg.out or "") / "config.toml"
    if not (cfg.resume and cfg.out and saved.is_file()):
        return None
    value = load_toml(saved).get("threads")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _create_runtime(cfg: TrainConfig) -> Runtime:
    check_machine(cfg.sync_spec)  # before the world starts
    if cfg.backend == "sim":
        world = SimWorld(cfg.workers, cfg.bandwidth, cfg.latency, timeout=cfg.timeout,
                         ranks_per_node=cfg.ranks_per_node or 1, intra_bandwidth=cfg.intra_bandwidth,
                         intra_latency=cfg.intra_latency)
        return Runtime(device=torch.device(cfg.resolved_device), rank=0, num_workers=cfg.workers, world=world)
    comm = init_communicator(cfg.backend, timeout=cfg.timeout)
    if comm.world_size > 1:
        comm.control()  # collective: made here, at start-up, on every rank
    if cfg.ranks_per_node and not os.environ.get("GRADZIP_NODE"):
        # Emulated nodes (local processes, testbed hosts): ranks r // ranks_per_node share one.
        os.environ["GRADZIP_NODE"] = str(comm.rank // cfg.ranks_per_node)
    device = torch.device("cpu")
    if cfg.resolved_device == "cuda":
        device = torch.device("cuda", _local_rank(comm.rank) % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    return Runtime(device=device, rank=comm.rank, num_workers=comm.world_size, comm=comm)


def _local_rank(rank: int) -> int:
    for var in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return rank


def build_data(cfg: TrainConfig, runtime: Runtime) -> Any:
    """The data pipeline. Every rank calls it at once: the cache builders hold inter-process
    locks, so one process builds and the others wait on the lock and then load (no collective,
    so a long first build cannot hit the communicator's timeout)."""
    if is_generated(cfg.corpus):  # the calibrated tier: its vocabulary is the language's
        return GeneratedData.build(cfg.corpus, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
    vocab = cfg.vocab_size or bert_config(cfg.model).vocab_size  # the model size's default vocabulary
    data = PretrainData.build(corpus=cfg.corpus, seq_len=cfg.seq_len, vocab_size=vocab, seed=cfg.seed,
                              progress=cfg.progress and runtime.is_main, tokenizer=cfg.tokenizer)
    if cfg.whole_word_masking:
        _ = data.continuation  # a tokenizer without word pieces fails here, before the first step
    return data
