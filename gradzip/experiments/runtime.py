"""The pieces :func:`gradzip.experiments.train.train` puts together, kept out of its loop:
the communicator/world and device (:class:`Runtime`), the output directory, per-worker RNG
streams, mixed precision, evaluation and the progress bar.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gradzip.errors import GradzipError
from gradzip.experiments.config import TrainConfig, load_toml

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
        for name in ("bytes_sent", "bytes_recv", "seconds", "calls"):
            setattr(st, name, getattr(saved, name))
        st.by_op.clear()
        st.by_op.update(saved.by_op)


def create_runtime(cfg: TrainConfig) -> Runtime:
    """sim: a SimWorld of ``cfg.workers``. Real backends: this rank's communicator, from the
    launcher's environment (world size from there, not from ``--workers``)."""
    if cfg.backend == "sim":
        from gradzip.comm.sim import SimWorld

        world = SimWorld(cfg.workers, cfg.bandwidth, cfg.latency, timeout=cfg.timeout)
        return Runtime(device=torch.device(cfg.resolved_device), rank=0, num_workers=cfg.workers, world=world)
    from gradzip.comm import init_communicator

    comm = init_communicator(cfg.backend, timeout=cfg.timeout)
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


# ---------------------------------------------------------------------- output directory
def check_out_dir(cfg: TrainConfig) -> Path:
    """Refuse a non-empty ``--out`` unless resuming; when resuming, refuse a changed config.
    Reads only: nothing is created or touched here."""
    out = Path(cfg.out or "")
    if out.exists() and not out.is_dir():
        raise GradzipError(f"--out {out} exists and is not a directory; choose another --out")
    nonempty = out.is_dir() and any(out.iterdir())
    if nonempty and not cfg.resume:
        raise GradzipError(f"--out {out} exists and is not empty; pass --resume to continue that run, "
                           "or choose another --out")
    if cfg.resume and nonempty:
        from gradzip.experiments.checkpoint import latest_checkpoint

        if latest_checkpoint(out) is None:
            raise GradzipError(f"--resume: {out} holds no checkpoint (ckpt-*.pt) to continue from; "
                               "run with --checkpoint-every N, or choose another --out")
    saved = out / "config.toml"
    if cfg.resume and saved.exists():
        old = TrainConfig.from_dict(load_toml(saved), source=str(saved))
        changed = cfg.diff(old)
        if changed:
            raise GradzipError(f"--resume: the run in {out} used different settings ({'; '.join(changed)}); "
                               "resume with the same settings, or choose another --out")
    return out


def build_data(cfg: TrainConfig, rt: Runtime) -> Any:
    """The data pipeline. Every rank calls it at once: the cache builders hold inter-process
    locks, so one process builds and the others wait on the lock and then load (no collective,
    so a long first build cannot hit the communicator's timeout)."""
    from gradzip.data import PretrainData
    from gradzip.models import bert_config

    vocab = cfg.vocab_size or bert_config(cfg.model).vocab_size  # the model size's default vocabulary
    return PretrainData.build(corpus=cfg.corpus, seq_len=cfg.seq_len, vocab_size=vocab, seed=cfg.seed,
                              progress=cfg.progress and rt.is_main, tokenizer=cfg.tokenizer)


# ---------------------------------------------------------------------- randomness
def seed_everything(seed: int) -> None:
    """Seed torch (all devices), numpy and Python: same seed, same model init and same run."""
    import random

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class WorkerRNG:
    """One torch RNG stream per worker, used for dropout while that worker computes.

    Worker ``w`` draws from the same stream whether it is a ``sim`` worker or real rank ``w``,
    so ``sim`` and real backends see the same dropout masks, and a worker's masks do not depend
    on how many workers ran before it in the same process. Checkpointed per worker.
    """

    def __init__(self, seed: int, worker_ids: list[int], device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        with torch.random.fork_rng(devices=[device] if self.cuda else []):
            for w in worker_ids:
                ws = int(np.random.SeedSequence([seed, w]).generate_state(1, dtype=np.uint64)[0] % 2**63)
                torch.manual_seed(ws)
                self.states[w] = self._get()

    def _get(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.get_rng_state(), (torch.cuda.get_rng_state() if self.cuda else None)

    def _set(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if self.cuda and state[1] is not None:
            torch.cuda.set_rng_state(state[1])

    @contextlib.contextmanager
    def use(self, w: int) -> Iterator[None]:
        """Make worker ``w``'s stream the global torch RNG for the duration."""
        self._set(self.states[w])
        try:
            yield
        finally:
            self.states[w] = self._get()

    def state_dict(self) -> dict[str, Any]:
        ws = sorted(self.states)
        return {"workers": ws, "cpu": [self.states[w][0] for w in ws],
                "cuda": [self.states[w][1] for w in ws] if self.cuda else []}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sorted(sd["workers"]) != sorted(self.states):
            raise GradzipError(f"checkpoint has RNG streams for workers {sd['workers']}, "
                               f"this process runs workers {sorted(self.states)}")
        for i, w in enumerate(sd["workers"]):
            cuda = sd["cuda"][i] if self.cuda and sd["cuda"] else self.states[w][1]
            self.states[w] = (sd["cpu"][i], cuda)


# ---------------------------------------------------------------------- precision
class Precision:
    """fp32; bf16 autocast (CPU or CUDA); fp16 autocast with a GradScaler (CUDA only).

    Parameters and their gradients stay fp32; the compressors see the gradients as they are.
    """

    def __init__(self, precision: str, device: torch.device) -> None:
        self.device = device
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], clip: float) -> float:
        """Unscale (fp16), clip to ``clip`` (0: off), step. Returns the gradient norm before clipping."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.nn.utils.get_total_norm(grads)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        return float(norm)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.scaler is not None and sd:
            self.scaler.load_state_dict(sd)


# ---------------------------------------------------------------------- batches and evaluation
def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def evaluate(model: nn.Module, data: Any, cfg: TrainConfig, prec: Precision, device: torch.device) -> dict[str, float]:
    """Mean held-out loss over ``cfg.eval_batches`` batches. Uses no randomness of the run (the
    RNG is forked), so evaluating does not change the training that follows."""
    was_training = model.training
    model.eval()
    sums = np.zeros(3)
    n = 0
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for batch in data.eval_batches(batch_size=cfg.batch_size, max_batches=cfg.eval_batches):
                with prec.autocast():
                    out = model(**to_device(batch, device))
                sums += [float(out.loss), float(out.mlm_loss), float(out.nsp_loss)]
                n += 1
    finally:
        model.train(was_training)
    if n == 0:
        return {}
    loss, mlm, nsp = (float(x) / n for x in sums)  # Python floats: they go into checkpoints
    return {"eval_loss": loss, "eval_mlm_loss": mlm, "eval_nsp_loss": nsp}


# ---------------------------------------------------------------------- progress bar
class Progress:
    """tqdm bar on rank 0: loss, tokens/s and MB sent per step (nothing elsewhere, or with
    ``--no-progress`` or ``GRADZIP_NO_PROGRESS=1``)."""

    def __init__(self, enabled: bool, total: int, initial: int) -> None:
        self.bar = None
        if enabled and not os.environ.get("GRADZIP_NO_PROGRESS"):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, desc="train")

    def update(self, rec: dict[str, Any], step_tokens: float) -> None:
        if self.bar is None:
            return
        tok_s = step_tokens / rec["step_s"] if rec.get("step_s") else 0.0
        post = {"loss": f"{rec['loss']:.3f}", "tok/s": f"{tok_s:,.0f}", "MB/step": f"{rec['bytes_sent'] / 1e6:.2f}"}
        if rec.get("eval_loss") is not None:
            post["eval"] = f"{rec['eval_loss']:.3f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
