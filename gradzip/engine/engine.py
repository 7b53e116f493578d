"""The gradient-exchange engine: attach compression + communication to any ``nn.Module``. Usage (one process
per rank; with a :class:`SimWorld` one process hosts every worker)::

    engine = attach(model, "topk:ratio=0.01,ef=true", comm)   # comm: a Communicator or a SimWorld
    for step in range(steps):
        for w in engine.worker_ids:
            with engine.worker(w):                 # zeroes .grad; sim: selects worker w
                loss_fn(model, batch_for(w)).backward()
        stats = engine.finalize()                  # averaged gradients are now in p.grad
        optimizer.step()

Per step, on each worker:

1. At start-up (in :func:`attach`), ranks compare a fingerprint of the model and the compressor
   spec, and parameters (and floating-point buffers) are broadcast from rank 0.
2. Parameters are grouped into buckets (see :mod:`gradzip.plan.buckets`: reverse registration
   order, a cap in MiB, dtype-homogeneous, small tensors apart and exchanged uncompressed).
3. A hook on every parameter (``register_post_accumulate_grad_hook``) copies its gradient into
   its bucket's flat buffer. When a bucket is full *and* every lower-index bucket has launched,
   it is compressed and its exchange launched asynchronously (:class:`Exchange.start`) while
   backward goes on. Launching strictly in index order keeps the collectives of all ranks in the
   same order whatever order the hooks fire in, as DDP does.
4. :meth:`Engine.finalize` launches the buckets that never filled (parameters unused this step are
   sent as their accumulated gradient, or zeros, so that no rank waits forever), then works in
   waves over the buckets in index order: wait for a bucket's current round, then launch its next
   round (PowerSGD) or decode it and write the average into ``p.grad``.

Granularity: element-wise compressors get each bucket as one flat tensor; compressors that override
``compress_batch`` (PowerSGD: per matrix, batched by shape) get the bucket's per-parameter views. A parameter
unused by every worker gets a zero gradient (not ``None``), on every backend.

Non-finite gradients: every bucket's local gradient is summed (in fp32, one read pass, no host sync) as it
launches, and :meth:`Engine.finalize` reports in ``StepStats.nonfinite`` how many of this process's workers saw
an inf or NaN (a finite gradient whose fp32 sum overflows, entries near 1e38, counts too: Adam's squared
gradient would overflow long before). The compressors' state updates of a step (error memory, PowerSGD's Q,
counters) stay undoable until the next step starts: when any rank's gradient was not finite, every rank calls
:meth:`Engine.skip_step` instead of the optimizer, and the step leaves no trace in the model, the optimizer or
the compressors::

    stats = engine.finalize()
    if engine.agree_finite(stats):   # one tiny allreduce (sim: none); gradzip train folds
        optimizer.step()             # the flag into its per-step metrics reduction instead
    else:
        engine.skip_step()

Optimizers that compress something other than the gradient (1-bit Adam and 1-bit LAMB exchange the momentum,
DeMo a scaled gradient: :mod:`gradzip.optim`) give an :class:`ExchangePlan` at the start of every step through
:meth:`Engine.bind_optimizer`: exchange uncompressed (their warm-up), or transform each bucket's local gradient
in place before it is compressed.

``no_sync()`` makes the hooks do nothing: gradients accumulate in ``.grad`` and are exchanged on the next
backward outside ``no_sync()`` (gradient accumulation, as DDP's ``no_sync``).

Time: real backends report measured wall times (exposed communication: the time in ``finalize`` beyond the
engine's own work); ``sim`` reports the virtual clock of :mod:`gradzip.cluster.schedule`, built from local work
timed in CPU time (``comm.work_time``). ``bucket_cap_mb`` trades overlap against per-collective latency (25 MiB
is DDP's default); ``min_compress_numel`` below ~1000 rarely pays.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from gradzip.cluster.schedule import BucketTiming, Span
from gradzip.comm.base import Communicator
from gradzip.comm.cost import allreduce_bytes
from gradzip.comm.sim import SimWorld
from gradzip.compress.base import Compressor, unflatten
from gradzip.compress.none import NoCompression
from gradzip.compress.registry import create
from gradzip.engine.config import EngineConfig
from gradzip.engine.exchange import Exchange
from gradzip.engine.startup import fingerprint_options, hosted, start_up
from gradzip.engine.stats import StepStats
from gradzip.engine.synchronizer import ExchangePlan, OptimizerStep, ShapesExchange
from gradzip.engine.timing import step_stats
from gradzip.engine.worker import _Hook, _Worker, write_back
from gradzip.errors import GradzipError
from gradzip.plan.buckets import Bucket, MiB


class Engine:
    """See the module docstring. Build with :func:`attach`."""

    def __init__(self, model: torch.nn.Module, compressor: str | Compressor, comm: Communicator | SimWorld,
                 config: EngineConfig | None = None) -> None:
        self.model = model
        self.config = config if config is not None else EngineConfig()
        self.sim, comms = hosted(comm, "attach")
        # Local work is timed on the communicator's clock: wall time, or sim's CPU time (comm.work_time).
        self._now = comms[0].work_time
        base = create(compressor)
        self.spec = base.spec
        named = list(model.named_parameters())
        self._trainable = [p for _, p in named if p.requires_grad]
        if not self._trainable:
            raise GradzipError("attach: the model has no parameters with requires_grad=True")
        cfg = self.config
        # Buckets, the ranks' agreement, rank 0's state, a compressor and a scheme per worker.
        start = start_up(model, base, comms, sim=self.sim, named=named, cap_bytes=max(1, int(cfg.bucket_cap_mb * MiB)),
                         min_compress_numel=cfg.min_compress_numel, check=cfg.check, broadcast=cfg.broadcast,
                         options=fingerprint_options(cfg.bucket_cap_mb, cfg.min_compress_numel, cfg.hierarchical,
                                                     cfg.intra_dtype),
                         agree=cfg.agree, hierarchical=cfg.hierarchical, intra_dtype=cfg.intra_dtype)
        self.buckets = start.buckets
        self._empty = [p for p in self._trainable if p.numel() == 0]
        self._plain = NoCompression()
        # Built after the start-up: each worker's stats snapshot leaves start-up traffic out of step 1.
        self._workers = [_Worker(c.rank, c, comp, self.buckets) for c, comp in zip(comms, start.compressors)]
        for w, scheme in zip(self._workers, start.schemes):
            w.scheme = scheme
            w.stateful = [w.compressor] + [c for c in w.scheme.compressors() if c is not w.compressor]
        self._current: _Worker | None = None
        self._no_sync = False
        # Optimizer-level compression (1-bit Adam/LAMB): exchange uncompressed while False, and a
        # transform of each bucket's local gradient before it is compressed (the local momentum).
        # Both are set from the bound optimizer's plan at the start of each step (bind_optimizer).
        self.compressing = True
        self.transform: Callable[[Bucket, Tensor], None] | None = None
        self._shaper: ShapesExchange | None = None
        self._grad_is_update = False  # p.grad will hold what the optimizer applies unclipped
        # Per-bucket timings of the last step (sim: mean over workers), for overlap analysis, and
        # its schedule (sim: the virtual clock's; real: this rank's measured), see cluster.schedule.
        self.last_timings: list[BucketTiming] = []
        self.last_schedule: list[Span] = []

        self._hooks = [p.register_post_accumulate_grad_hook(_Hook(functools.partial(self._on_grad, b.index, i)))
                       for b in self.buckets for i, p in enumerate(b.params)]
        self._hooks.append(model.register_forward_pre_hook(_Hook(self._on_forward)))
        self._last_end = self._now()

    # ------------------------------------------------------------------ public API
    @property
    def num_workers(self) -> int:
        """Workers hosted by this process: N for sim, 1 for real backends."""
        return len(self._workers)

    @property
    def worker_ids(self) -> list[int]:
        return [w.id for w in self._workers]

    @property
    def world_size(self) -> int:
        return self._workers[0].comm.world_size

    eval_on_every_rank = False  # the Synchronizer protocol: a replicated model evaluates on rank 0

    def summary(self) -> dict[str, Any]:
        """No fields of its own in ``summary.json`` (the protocol's)."""
        return {}

    def fp32_bytes(self, n_params: int) -> int:
        """A ring allreduce of ``n_params`` fp32 gradients (the protocol's baseline)."""
        return allreduce_bytes(4 * n_params, self.world_size)

    @property
    def comm(self) -> Communicator:
        """The current worker's communicator (outside ``worker()``: the first one)."""
        return (self._current or self._workers[0]).comm

    @property
    def compressor(self) -> Compressor:
        """The current worker's compressor (outside ``worker()``: the first one)."""
        return (self._current or self._workers[0]).compressor

    @property
    def exchange(self) -> str:
        """The compressor's exchange scheme (``allreduce``, ``allgather``, ``twophase``, ...)."""
        return self._workers[0].compressor.exchange

    def set_plan(self, plan: ExchangePlan) -> None:
        """What to exchange from the next bucket on: see :class:`ExchangePlan`."""
        self.compressing, self.transform = plan.compress, plan.transform

    def bind_optimizer(self, optimizer: Any) -> None:
        """Follow ``optimizer``'s :class:`ExchangePlan` (asked at the start of every step) when it
        decides what is exchanged (:class:`ShapesExchange`: 1-bit Adam/LAMB, DeMo); else nothing."""
        self._shaper = optimizer if isinstance(optimizer, ShapesExchange) else None

    @contextlib.contextmanager
    def worker(self, wid: int) -> Iterator[Communicator]:
        """Run worker ``wid``'s forward/backward inside this block. Zeroes ``.grad`` on entry.
        Sim: selects that worker's communicator and compressor state. Real: ``wid`` is the rank."""
        if self._current is not None:
            raise GradzipError("engine.worker() blocks cannot be nested")
        w = self._lookup(wid)
        if w.entered:
            raise GradzipError(f"worker {wid} already ran this step; call engine.finalize() before running it again")
        if self._shaper is not None and not any(x.entered for x in self._workers):  # the step's first worker
            self.set_plan(self._shaper.exchange_plan())
            self._grad_is_update = self._shaper.grad_is_update
        for p in self._trainable:
            p.grad = None
        w.entered = True
        self._current = w
        w.t_start = self._now()
        try:
            yield w.comm
        finally:
            self._current = None
        w.t_end = self._now()
        if self.sim:  # the next worker zeroes .grad: launch whatever this worker left now
            self._flush(w)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: inside, backward only accumulates into ``.grad``."""
        prev, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = prev

    def finalize(self) -> StepStats:
        """Wait for every bucket, write the averaged gradients into ``p.grad``, return the stats."""
        t_fin = self._now()
        if self.sim:
            missing = [w.id for w in self._workers if not w.entered]
            if missing:
                raise GradzipError(f"finalize(): worker(s) {missing} did not run this step; run each of "
                                   "engine.worker_ids inside `with engine.worker(w):` before finalize()")
        for w in self._workers:
            if not w.flushed:
                if w.t_end is None:
                    w.t_end = t_fin
                self._flush(w)
        self._drain()
        for p in self._empty:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        t_done = self._now()
        stats, self.last_timings, self.last_schedule = step_stats(self._workers, len(self.buckets), self.sim,
                                                                    t_fin, t_done, self._last_end)
        # One host sync for the whole step (finalize waits for the network anyway).
        stats.nonfinite = sum(1 for w in self._workers
                              if w.sums and not bool(torch.isfinite(torch.stack(w.sums).sum())))
        for w in self._workers:
            w.snap = w.comm.stats.snapshot()
            w.reset(self.buckets)
        self._last_end = self._now()
        return stats

    # ------------------------------------------------------------------ the Synchronizer protocol
    def after_backward(self, stepper: OptimizerStep) -> None:
        """Nothing: the exchange already runs in backward's hooks, and the optimizer steps once, in
        :meth:`commit`, on the averaged gradient."""

    def synchronize(self) -> StepStats:
        """:meth:`finalize`: the averaged gradients are in ``p.grad``."""
        return self.finalize()

    def commit(self, nonfinite: int, stepper: OptimizerStep) -> float:
        """Step the optimizer on the averaged gradient, or, when any rank's gradient was not finite
        (``nonfinite`` > 0, the same on every rank), undo the step everywhere (:meth:`skip_step`)."""
        if nonfinite:
            self.skip_step()
            stepper.skip()
            return float("nan")
        return stepper.step(clip=not self._grad_is_update)

    def agree_finite(self, stats: StepStats) -> bool:
        """True when every rank's gradient of the step that ``stats`` reports was finite. Real backends: one
        allreduce of one number (its bytes count in the next step's stats); sim: local."""
        bad = float(stats.nonfinite)
        if not self.sim and self.world_size > 1:
            t = torch.tensor([bad], dtype=torch.float32, device=self.buckets[0].device)
            self.comm.allreduce(t, "sum")
            bad = float(t.item())
        return bad == 0

    def skip_step(self) -> None:
        """Undo the step :meth:`finalize` just ended: compressor states go back to the step's start and ``p.grad``
        is dropped (None), so a mistaken optimizer step changes nothing. Call it on every rank, or on none."""
        for w in self._workers:
            self._settle(w, keep=False)
        for p in self._trainable:
            p.grad = None

    def _settle(self, w: _Worker, keep: bool) -> None:
        if w.open:
            for c in w.stateful:
                c.end_step(keep)
            w.open = False

    def state_dict(self) -> dict[str, Any]:
        """Every local worker's compressor state (sim: N entries; real: this rank's)."""
        for w in self._workers:
            self._settle(w, keep=True)
        return {"spec": self.spec, "worker_ids": self.worker_ids,
                "compressors": [w.compressor.state_dict() for w in self._workers],
                "schemes": [w.scheme.state_dict() for w in self._workers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("spec") != self.spec:
            raise GradzipError(f"engine state is for compressor {state.get('spec')!r}, not {self.spec!r}")
        if list(state.get("worker_ids", [])) != self.worker_ids:
            raise GradzipError(f"engine state is for workers {state.get('worker_ids')}, this engine hosts "
                               f"{self.worker_ids}; resume with the same backend and number of workers")
        for w in self._workers:
            self._settle(w, keep=True)
        for w, sd in zip(self._workers, state["compressors"]):
            w.compressor.load_state_dict(sd)
        for w, sd in zip(self._workers, state.get("schemes", [{}] * len(self._workers))):
            w.scheme.load_state_dict(sd)

    def detach(self) -> None:
        """Remove the hooks; the model trains as if the engine had never been attached."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __repr__(self) -> str:
        where = f"sim x{self.num_workers}" if self.sim else f"rank {self.comm.rank}/{self.world_size}"
        return f"<Engine {self.spec} {where} {len(self.buckets)} buckets>"

    # ------------------------------------------------------------------ hooks
    def _lookup(self, wid: int) -> _Worker:
        for w in self._workers:
            if w.id == wid:
                return w
        raise GradzipError(f"worker id {wid} is not one of this engine's workers {self.worker_ids}")

    def _active(self) -> _Worker:
        if self._current is not None:
            return self._current
        if self.sim:
            raise GradzipError("sim mode: run each worker's forward/backward inside `with engine.worker(w):`")
        return self._workers[0]

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():  # evaluation forwards do not start a step
            return
        w = self._current if self.sim else (self._current or self._workers[0])
        if w is not None and w.fwd_start is None:
            w.fwd_start = self._now()

    def _on_grad(self, bi: int, si: int, param: Tensor) -> None:
        if self._no_sync:
            return
        t0 = self._now()
        w = self._active()
        b = self.buckets[bi]
        if w.ready[bi][si] or w.flushed:
            raise GradzipError(f"parameter {b.names[si]!r} got a second gradient in one step outside no_sync(); "
                               "wrap all but the last backward of a step in engine.no_sync()")
        if w.fwd_start is None:
            w.fwd_start = w.t_start if w.t_start is not None else self._last_end
        w.buffer(b).narrow(0, b.offsets[si], b.numels[si]).copy_(param.grad.reshape(-1))
        w.ready[bi][si] = 1
        w.pending[bi] -= 1
        w.pack_s[bi] += self._now() - t0
        if w.pending[bi] == 0:
            self._launch_ready(w, ready_s=(t0 - w.fwd_start) - w.hook_s)
        w.hook_s += self._now() - t0

    # ------------------------------------------------------------------ exchange
    def _launch_ready(self, w: _Worker, ready_s: float) -> None:
        """Launch, in index order, every bucket that is full and whose predecessors launched."""
        while w.next_launch < len(self.buckets) and w.pending[w.next_launch] == 0:
            if w.next_launch == 0:  # the step's first compression: the last step is kept, this one opens
                self._settle(w, keep=True)
                for c in w.stateful:
                    c.begin_step()
                w.open = True
            b = self.buckets[w.next_launch]
            buf = w.buffer(b)
            if self.transform is not None:
                self.transform(b, buf)
            w.sums.append(torch.sum(buf, dtype=torch.float32))
            comp, scheme = self._select(w, b)
            tensors = unflatten(buf, b.shapes) if comp.per_tensor else [buf]
            ex = scheme.exchange(comp, tensors, b.key)
            t_enc = self._now()
            ex.start()
            w.exchanges[b.index] = ex
            if not self.sim:
                w.launched[b.index] = t_done = self._now()
                w.marks.append(("compute", "encode", t_enc, t_done, b.index, None))
            w.timing[b.index] = BucketTiming(ready_s=max(ready_s, 0.0), compress_s=w.pack_s[b.index] + ex.compress_s)
            w.next_launch += 1

    def _flush(self, w: _Worker) -> None:
        """End of a worker's backward: fill the slots no hook filled (accumulated gradient from
        no_sync micro-steps, or zeros for unused parameters) and launch the remaining buckets."""
        t0 = self._now()
        start = w.fwd_start if w.fwd_start is not None else (w.t_start if w.t_start is not None else self._last_end)
        w.fwd_start = start
        compute = (w.t_end if w.t_end is not None else t0) - start - w.hook_s
        for b in self.buckets:
            if not w.pending[b.index]:
                continue
            tb = self._now()
            buf = w.buffer(b)
            for si, p in enumerate(b.params):
                if not w.ready[b.index][si]:
                    dst = buf.narrow(0, b.offsets[si], b.numels[si])
                    if p.grad is None:
                        dst.zero_()
                    else:
                        dst.copy_(p.grad.reshape(-1))
            w.pending[b.index] = 0
            w.pack_s[b.index] += self._now() - tb
        self._launch_ready(w, ready_s=compute)
        w.flushed = True
        w.fin_s += self._now() - t0

    @torch.no_grad()
    def _drain(self) -> None:
        """Waves over the buckets in index order until every exchange is decoded and written back."""
        pending = list(range(len(self.buckets)))
        while pending:
            still = []
            for bi in pending:
                done = True  # once every worker's exchange is (a hierarchical one may wait a wave for its leader)
                for w in self._workers:
                    ex = w.exchanges[bi]
                    assert ex is not None
                    c0, rnd, t0 = ex.compress_s, ex.round, self._now()
                    # sim: the workers' one-pass decodes of the same gathered payloads are one computation
                    first = self._workers[0].exchanges[bi]
                    mine = (self.sim and type(ex) is Exchange and ex is not first and ex.adopt(first)) or ex.advance()  # type: ignore[arg-type]
                    done = done and mine
                    dc = ex.compress_s - c0
                    if not self.sim:
                        self._mark(w, bi, rnd, t0, self._now(), dc, mine)
                    w.fin_s += dc
                    if mine:
                        w.timing[bi].decode_s += dc
                    else:
                        w.timing[bi].between_s.append(dc)
                if done:
                    # Every worker's result is the same (each gets the same reduced payloads and
                    # decoding is deterministic; the multi-process tests compare sim with Gloo/MPI),
                    # so the one shared model takes worker 0's.
                    t0 = self._now()
                    write_back(self.buckets[bi], self._workers[0].exchanges[bi].result())  # type: ignore[union-attr]
                    dt = self._now() - t0
                    if not self.sim:
                        self._workers[0].marks.append(("compute", "decode", t0, t0 + dt, bi, None))
                    for w in self._workers:  # every real worker writes its own .grad
                        w.timing[bi].decode_s += dt
                        w.fin_s += dt
                else:
                    still.append(bi)
            pending = still

    @staticmethod
    def _mark(w: _Worker, bi: int, rnd: int, t0: float, t1: float, work_s: float, last: bool) -> None:
        """Record one advance() of a real backend: the wait for round ``rnd`` (in flight on the link
        since its launch), then the work after it (decode, or the next round's compression)."""
        waited = t1 - work_s
        w.marks.append(("link", "round", w.launched.get(bi, t0), waited, bi, rnd))
        w.marks.append(("compute", "wait", t0, waited, bi, rnd))
        w.marks.append(("compute", "decode" if last else "between", waited, t1, bi, None if last else rnd))
        w.launched[bi] = t1

    def _select(self, w: _Worker, b: Bucket) -> tuple[Compressor, Any]:
        """Bucket ``b``'s compressor and exchange scheme this step (the auto policy: its plan's)."""
        return (w.compressor if b.compressed and self.compressing else self._plain), w.scheme


def attach(model: torch.nn.Module, compressor: str | Compressor = "none", comm: Communicator | SimWorld | None = None,
           bucket_cap_mb: float = 25.0, min_compress_numel: int = 1024, broadcast: bool = True,
           check: bool = True, agree: dict[str, Any] | None = None, hierarchical: bool = False,
           intra_dtype: str = "") -> Engine:
    """Attach gradzip to ``model``: see :class:`Engine` and the module docstring.

    ``comm``: a Communicator (one rank per process; e.g. from :func:`gradzip.comm.init_communicator`)
    or a :class:`SimWorld` (every worker in this process, virtual clock). ``agree``: settings of
    yours that every rank must share (JSON-able values); compared at start-up.
    """
    if comm is None:
        raise GradzipError("attach: pass a communicator (gradzip.comm.init_communicator(...)) or a SimWorld(n)")
    config = EngineConfig(bucket_cap_mb=bucket_cap_mb, min_compress_numel=min_compress_numel,
                          broadcast=broadcast, check=check, agree=dict(agree or {}), hierarchical=hierarchical,
                          intra_dtype=intra_dtype)
    return Engine(model, compressor, comm, config)
