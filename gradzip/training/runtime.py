"""Where this training process runs: the communicator or simulated world and the device
(:class:`Runtime`), and the data pipeline every rank builds at once."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gradzip.comm import init_communicator
from gradzip.comm.sim import SimWorld
from gradzip.data import PretrainData
from gradzip.models import bert_config
from gradzip.training.config import TrainConfig

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

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def target(self) -> Any:
        """What :func:`gradzip.engine.attach` takes: the SimWorld, or this rank's communicator."""
        return self.world if self.world is not None else self.comm

    def barrier(self) -> None:
        if self.comm is not None:
            with uncounted(self.comm):
                self.comm.barrier()

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        """Sum of ``values`` over real ranks (identity for sim). Not counted in the byte stats:
        logging is not part of the measured exchange."""
        if self.comm is None or self.comm.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        with uncounted(self.comm):
            self.comm.allreduce(t, "sum")
        return t.tolist()

    def broadcast_str(self, text: str | None) -> str:
        """Rank 0's ``text`` on every rank (e.g. the auto-generated --out directory)."""
        if self.comm is None or self.comm.world_size == 1:
            return text or ""
        buf = torch.zeros(1024, dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            raw = (text or "").encode()[:1024]
            buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        with uncounted(self.comm):
            self.comm.broadcast(buf, 0)
        return bytes(buf.cpu().tolist()).rstrip(b"\0").decode()

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()


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
    launcher's environment (world size from there, not from ``--workers``)."""
    if cfg.backend == "sim":
        world = SimWorld(cfg.workers, cfg.bandwidth, cfg.latency, timeout=cfg.timeout,
                         ranks_per_node=cfg.ranks_per_node or 1, intra_bandwidth=cfg.intra_bandwidth,
                         intra_latency=cfg.intra_latency)
        return Runtime(device=torch.device(cfg.resolved_device), rank=0, num_workers=cfg.workers, world=world)
    comm = init_communicator(cfg.backend, timeout=cfg.timeout)
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
    vocab = cfg.vocab_size or bert_config(cfg.model).vocab_size  # the model size's default vocabulary
    return PretrainData.build(corpus=cfg.corpus, seq_len=cfg.seq_len, vocab_size=vocab, seed=cfg.seed,
                              progress=cfg.progress and runtime.is_main, tokenizer=cfg.tokenizer)
