"""Synchronise rarely: DiLoCo, Streaming DiLoCo and LocalSGD, with any compressor and exchange scheme.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105): each worker takes H inner steps of its own
optimizer on its own data; then the workers average the *pseudo-gradient* Δ = θ_global − θ_local
and every worker takes one *outer* step on the global copy (Nesterov SGD, lr 0.7, momentum 0.9 in
the paper). Per sync, on each worker:

1. Δ ← θ_global − θ_local, per bucket (the engine's bucket plan, :mod:`gradzip.plan.buckets`);
2. Δ goes through the worker's compressor (and its error memory, keyed per bucket) and the exchange
   scheme (``allreduce``, ``allgather``, ``twophase``, ``sparse``, hierarchical), exactly as a
   gradient does in :class:`gradzip.engine.Engine`; every byte is counted by the communicator;
3. the outer optimizer steps on θ_global with the averaged Δ as its gradient;
4. θ_local ← α·θ_local + (1 − α)·θ_global (α = ``fragment_update_alpha``, 0 by default).

Streaming DiLoCo (arXiv 2501.18512): ``fragments=P`` splits the buckets (capped at 1/(2P) of the
model, :func:`gradzip.plan.buckets.fragment_cap`) into P contiguous groups of about equal size;
fragment f is sent at inner step H − τ − (P−1−f)·H/P of each period and applied τ =
``fragment_sync_delay`` steps later, its collectives travelling during those inner steps (async
handles on gloo/mpi; on ``sim`` the link time is hidden behind the compute of those steps). Peak
bytes of one sync fall by P. LocalSGD is DiLoCo with an outer SGD of lr 1 and no momentum: the new
θ_global is the average of the workers' parameters.

Overlapped outer updates (``outer_overlap=1``, ``--sync ...,overlap=1``): the delayed outer update
of Kale, Douillard & Donchev 2025 (arXiv 2502.12996, "1-outer-step overlap") and DiLoCoX (arXiv
2506.21263, "one-step-delay overlap"), Streaming DiLoCo's τ stretched to a whole round. At the end
of round k (each fragment at its own send step): Δ_k = θ_global − θ_local is computed and its
exchange starts; the exchange of Δ_{k−1}, sent a round earlier, is finished; θ_global ←
OuterOpt(θ_global, Δ_{k−1}) (nothing at round 1); every worker starts round k + 1 from θ_global
(merged with α). Each exchange thus travels during H inner steps; the last one is never applied.
On ``sim`` the link is one first-in first-out pipe, so a round takes max(H·compute, link) instead of
the sum (plus the codec and outer-step work). Checkpoints finish the exchange in flight (below).
Module :mod:`gradzip.engine.diloco_state` holds the checkpoints and sim's per-worker swaps.

Use (one process per rank; the user's loop is unchanged, a step post-hook does the rest)::

    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    diloco = gradzip.DiLoCo(model, inner, outer, comm, sync_every=16, compressor="intk:bits=4")
    for batch in data:
        model(**batch).loss.backward(); inner.step(); inner.zero_grad()

With a :class:`SimWorld`, one process hosts every worker: run each worker's step inside
``with diloco.worker(w):`` (its replica is swapped into the model, and its inner optimizer state into
``inner`` through ``inner.load_state_dict``, never by assigning the optimizer's internals: fused and
foreach optimizers and state-dict hooks see what they expect; the param groups, the LR schedule's lr
among them, are shared by the workers); the sync runs once every worker stepped. Memory per rank:
one copy of the parameters (θ_global), the outer optimizer's state (one more copy for momentum) and
the compressor's error memory (one more copy with ``ef=true``); ``sim`` adds N replicas and N inner
optimizer states.

Contract: the outer optimizer must be built over the model's parameters; inner gradients are left
in place (other tensors' ``.grad`` is restored after the outer step). DDP's per-step allreduce does
not apply: do not wrap the model in DDP or attach the per-step engine as well.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from gradzip.comm.base import Communicator
from gradzip.comm.cost import allreduce_bytes
from gradzip.comm.sim import SimWorld
from gradzip.compress.base import unflatten
from gradzip.compress.bitpack import empty
from gradzip.compress.none import NoCompression
from gradzip.compress.registry import create
from gradzip.engine.diloco_state import DiLoCoState, _flat, _load, _store
from gradzip.engine.outer_step import fusable, fused_sgd_step
from gradzip.engine.startup import fingerprint_options, hosted, start_up
from gradzip.engine.stats import StepStats
from gradzip.engine.synchronizer import OptimizerStep
from gradzip.errors import GradzipError, SpecError
from gradzip.plan.buckets import Bucket, MiB, fragment_cap, split_fragments
from gradzip.plan.sync import parse_sync

T = TypeVar("T")


@dataclass(frozen=True)
class Finished:
    """One fragment's exchange at its end: the averaged Δ per bucket, its decode seconds, link
    seconds, link seconds not hidden behind inner steps, and [bytes sent, received, sent inside the
    node] (means over the workers here)."""

    results: list[list[Tensor]]
    compress_s: float
    link_s: float
    exposed_s: float
    sent: list[int]


@dataclass
class SyncStats:
    """What the syncs completed at one inner step cost (zeros on other steps). Bytes: what each sync
    sent from its launch to its end (a delayed fragment's bytes count at the step it is applied),
    mean over the workers hosted here; ``link_s``: modelled link seconds (sim) or measured wait (real)."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    intra_bytes_sent: int = 0
    compress_s: float = 0.0
    link_s: float = 0.0
    exposed_s: float = 0.0  # link time not hidden behind inner steps (sim: modelled; real: measured wait)
    sent: int = 0  # fragments sent at this step
    applied: int = 0  # fragments applied at this step


class DiLoCo(DiLoCoState):
    """See the module docstring. ``comm``: a Communicator (one rank per process) or a SimWorld.
    ``hook=False`` leaves the call of :meth:`after_inner_step` to the caller (``gradzip train``)."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: torch.optim.Optimizer, comm: Communicator | SimWorld, sync_every: int,
                 compressor: str = "none", fragments: int = 1, fragment_sync_delay: int = 0,
                 fragment_update_alpha: float = 0.0, *, bucket_cap_mb: float = 25.0, min_compress_numel: int = 1024,
                 hierarchical: bool = False, intra_dtype: str = "native", agree: dict[str, Any] | None = None,
                 outer_overlap: int = 0, hook: bool = True) -> None:
        try:
            self.sync = parse_sync(f"localsgd:every={sync_every},fragments={fragments},delay={fragment_sync_delay}"
                                   + (f",overlap={outer_overlap}" if outer_overlap else ""))
        except SpecError as e:
            raise GradzipError(str(e).replace("--sync localsgd: ", "DiLoCo: ")) from None
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise GradzipError(f"DiLoCo: fragment_update_alpha={fragment_update_alpha} must be in [0, 1]")
        self.alpha = float(fragment_update_alpha)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise GradzipError("DiLoCo replaces DDP's per-step allreduce: pass the module itself "
                               "(model.module), not the DistributedDataParallel wrapper")
        self.model, self.inner, self.outer = model, inner_optimizer, outer_optimizer
        self.sim, self.comms = hosted(comm)
        self._now = self.comms[0].work_time  # wall time, or sim's CPU time
        base = create(compressor)
        self.spec = base.spec
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        outer_ids = {id(p) for g in outer_optimizer.param_groups for p in g["params"]}
        if not all(id(p) in outer_ids for p in self.params):
            raise GradzipError("DiLoCo: the outer optimizer must be built over the model's parameters "
                               "(e.g. torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True))")
        total = sum(p.numel() * p.element_size() for p in self.params)
        options = {**fingerprint_options(bucket_cap_mb, min_compress_numel, hierarchical, intra_dtype),
                   "sync": str(self.sync), "alpha": self.alpha}
        self.fragments: list[list[int]] = []

        def split(buckets: list[Bucket]) -> None:  # before any collective: e.g. too few buckets
            self.fragments = split_fragments([b.numel for b in buckets], self.sync.fragments)

        start = start_up(model, base, self.comms, sim=self.sim, named=named, min_compress_numel=min_compress_numel,
                         cap_bytes=fragment_cap(total, max(1, int(bucket_cap_mb * MiB)), self.sync.fragments),
                         options=options, agree=agree, hierarchical=hierarchical, intra_dtype=intra_dtype,
                         on_plan=split)
        self.buckets: list[Bucket] = start.buckets
        self.compressors, self.schemes = start.compressors, start.schemes
        self._plain = NoCompression()
        self._per_tensor = base.per_tensor
        with torch.no_grad():
            self.global_ = [_flat(b).clone() for b in self.buckets]
            # sim: every worker's parameters and inner optimizer state between syncs
            self.replicas = [[g.clone() for g in self.global_] for _ in self.comms] if self.sim else []
        # sim: each worker's inner optimizer state, as the "state" of the optimizer's own state_dict()
        self.inner_states: list[dict[Any, Any]] = [{} for _ in self.comms] if self.sim else []
        self.step = 0
        self._current: int | None = None
        self._stepped: set[int] = set()
        self._inflight: dict[int, list[list[Any]]] = {}  # fragment -> per worker, per bucket: exchange
        self._results: dict[int, dict[str, Any]] = {}  # fragment -> averaged Δ per bucket and bytes (finished early)
        self._snaps: dict[int, list[dict[str, Any]]] = {}  # fragment -> communicator stats when it was sent
        self._counted: dict[int, list[list[int]]] = {}  # overlap=1: fragment -> bytes its own calls recorded
        self._compute_since: dict[int, float] = {}  # fragment -> compute seconds since it was sent
        self._link_idle = math.inf  # sim, overlap=1: seconds (compute and waits) since the link fell idle
        self._hook = inner_optimizer.register_step_post_hook(self._on_step) if hook else None
        self.last_schedule: list[Any] = []  # the Synchronizer protocol: no per-step schedule here
        self._t_step: float | None = None  # when this step's first worker started (its compute time)
        self._norms: list[float] = []  # this step's inner steps: gradient norms, and workers that skipped
        self._bad = 0

    # ------------------------------------------------------------------ public API
    eval_on_every_rank = False  # the Synchronizer protocol: a replicated model evaluates on rank 0

    def summary(self) -> dict[str, Any]:
        """No fields of its own in ``summary.json`` (the protocol's)."""
        return {}

    def fp32_bytes(self, n_params: int) -> int:
        """The per-step baseline: a ring allreduce of ``n_params`` fp32 gradients every step."""
        return allreduce_bytes(4 * n_params, self.comms[0].world_size)

    @property
    def worker_ids(self) -> list[int]:
        return [c.rank for c in self.comms]

    @property
    def exchange(self) -> str:
        """The compressor's exchange scheme."""
        return self.compressors[0].exchange

    @contextlib.contextmanager
    def worker(self, wid: int) -> Iterator[Communicator]:
        """Sim: run worker ``wid``'s inner step inside (its parameters and inner optimizer state are
        swapped in, and out again after; the state through the optimizer's ``load_state_dict`` and
        ``state_dict``). Real backends: ``wid`` is the rank; nothing to swap.
        Zeroes the model's ``.grad`` on entry."""
        i = self.worker_ids.index(wid)
        if self._t_step is None:
            self._t_step = self._now()
        for p in self.params:
            p.grad = None
        if not self.sim:
            yield self.comms[i]
            return
        self._swap_in(i)
        self._current = i
        _load(self.buckets, self.replicas[i])
        try:
            yield self.comms[i]
        finally:
            self._current = None
            _store(self.buckets, self.replicas[i])
            self._swap_out(i)
        if self._hook is not None and len(self._stepped) == len(self.comms):
            self._stepped.clear()
            self.after_inner_step()

    def after_inner_step(self, compute_s: float = 0.0) -> SyncStats:
        """Every worker took inner step ``self.step + 1``: send and apply the fragments due now.
        ``compute_s``: that step's compute time (sim: hides in-flight link time)."""
        self.step += 1
        r = (self.step - 1) % self.sync.every + 1
        st = SyncStats()
        for f in self._compute_since:
            self._compute_since[f] += compute_s
        self._link_idle += compute_s
        sends = self.sync.sends_at(self.step)
        if self.sync.overlap:  # the last round's exchange ends, this round's starts, then the last outer step
            due = {f: self._collect(f) for f in sends if f in self._inflight or f in self._results}
            for f in sends:
                self._send(f, st)
            for f in sends:
                if f in due:
                    self._apply(f, st, due[f])
                else:  # the first round: no outer step yet, yet every round starts from θ_global
                    self._merge(self.fragments[f])
        else:
            for f in sends:
                self._send(f, st)
            for f in range(len(self.fragments)):
                if f in self._inflight or f in self._results:
                    if (r - self.sync.send_step(f)) % self.sync.every == self.sync.delay:
                        self._apply(f, st, self._collect(f))
        if self.sim:
            _load(self.buckets, self.replicas[0])  # the model shows worker 0 (evaluation, checkpoints)
        return st

    # ------------------------------------------------------------------ the Synchronizer protocol
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to hold back: gradients stay local until the inner step."""
        return contextlib.nullcontext()

    def after_backward(self, stepper: OptimizerStep) -> None:
        """The worker's own inner step on its local gradient, or a skip, alone, when it is not finite."""
        sums = [torch.sum(p.grad, dtype=torch.float32) for p in self.params if p.grad is not None]
        if not sums or bool(torch.isfinite(torch.stack(sums).sum())):
            self._norms.append(stepper.step())
        else:
            stepper.skip()
            self._bad += 1

    def synchronize(self) -> StepStats:
        """Every worker took its inner step: send and apply the fragments due now
        (:meth:`after_inner_step`); ``syncs``: fragments applied. The compute time (per worker) hides
        in-flight link time on ``sim``."""
        compute = (self._now() - (self._t_step or self._now())) / len(self.comms)
        self._t_step = None
        st = self.after_inner_step(compute)
        return StepStats(compute_s=compute, compress_s=st.compress_s, comm_s=st.exposed_s,
                         bytes_sent=st.bytes_sent, bytes_recv=st.bytes_recv,
                         step_s=compute + st.compress_s + st.exposed_s,
                         clock="modelled" if self.sim else self.comms[0].clock, link_s=st.link_s,
                         intra_bytes_sent=st.intra_bytes_sent, nonfinite=self._bad, syncs=st.applied)

    def commit(self, nonfinite: int, stepper: OptimizerStep) -> float:
        """Nothing left to decide (each worker stepped or skipped alone): the inner steps' mean
        gradient norm (NaN when every worker here skipped)."""
        norms, self._norms, self._bad = self._norms, [], 0
        return sum(norms) / len(norms) if norms else float("nan")

    def detach(self) -> None:
        """Remove the inner optimizer's post-hook: the model trains as if DiLoCo had never been attached."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # ------------------------------------------------------------------ internals
    def _on_step(self, *_: Any) -> None:
        if not self.sim:
            self.after_inner_step()
        elif self._current is not None:
            self._stepped.add(self._current)

    def _delta(self, i: int, bi: int) -> Tensor:
        """Worker i's pseudo-gradient θ_global − θ_local of bucket bi (a new flat tensor, one pass)."""
        g = self.global_[bi]
        out = empty(g.numel(), g.dtype, g.device)  # numpy's allocation on the CPU: huge pages, fewer faults
        if self.sim:
            return torch.sub(g, self.replicas[i][bi], out=out)
        b = self.buckets[bi]
        for p, g, d in zip(b.params, unflatten(self.global_[bi], b.shapes), unflatten(out, b.shapes)):
            torch.sub(g, p.detach(), out=d)
        return out

    @torch.no_grad()
    def _send(self, f: int, st: SyncStats) -> None:
        """Compress and launch fragment f's pseudo-gradients on every worker."""
        t0 = self._now()
        self._snaps[f] = [c.stats.snapshot() for c in self.comms]
        per_worker = []
        for i, (comp, scheme) in enumerate(zip(self.compressors, self.schemes)):
            comp.begin_step()
            exs = []
            for bi in self.fragments[f]:
                b = self.buckets[bi]
                delta = self._delta(i, bi)
                c = comp if b.compressed else self._plain
                tensors = unflatten(delta, b.shapes) if b.compressed and self._per_tensor else [delta]
                ex = self._count(f, functools.partial(scheme.exchange, c, tensors, b.key))
                self._count(f, ex.start)
                exs.append(ex)
            per_worker.append(exs)
        self._inflight[f] = per_worker
        self._compute_since[f] = 0.0
        st.sent += 1
        st.compress_s += (self._now() - t0) / len(self.comms)

    def _count(self, f: int, call: Callable[[], T]) -> T:
        """``call()``; with overlap=1, the bytes every communicator here records during it are
        fragment f's (sim records a collective when its last rank issues it, gloo and mpi when it
        completes: either way inside one of f's own calls)."""
        if not self.sync.overlap:
            return call()
        snaps = [c.stats.snapshot() for c in self.comms]
        out = call()
        acc = self._counted.setdefault(f, [[0, 0, 0] for _ in self.comms])
        for a, c, snap in zip(acc, self.comms, snaps):
            d = c.stats.since(snap)
            for k, key in enumerate(("bytes_sent", "bytes_recv", "intra_bytes_sent")):
                a[k] += int(d[key])
        return out

    def _finish(self, f: int) -> tuple[list[list[Tensor]], float, float, list[int]]:
        """Drive fragment f's exchanges to the end: (averaged Δ per bucket, compress s, link s,
        [bytes sent, received, sent inside the node] per worker, mean over the workers here)."""
        per_worker = self._inflight.pop(f)
        t0 = self._now()
        enc = 0.0
        pending = list(range(len(self.fragments[f])))
        while pending:
            still = []
            for j in pending:
                done = True
                for exs in per_worker:
                    c0 = exs[j].compress_s
                    done = self._count(f, exs[j].advance) and done
                    enc += exs[j].compress_s - c0
                if not done:
                    still.append(j)
            pending = still
        for comp in self.compressors:
            comp.end_step(True)
        wall = self._now() - t0
        if self.sim:  # the slowest worker's modelled link time
            link = max(sum(sum(ex.link_s) for ex in exs) for exs in per_worker)
        else:
            link = max(0.0, wall - enc)
        keys = ("bytes_sent", "bytes_recv", "intra_bytes_sent")
        deltas = [c.stats.since(snap) for c, snap in zip(self.comms, self._snaps.pop(f))]
        if self.sync.overlap:  # several fragments in flight at once: what f's own calls recorded
            deltas = [dict(zip(keys, acc)) for acc in self._counted.pop(f)]
        sent = [round(sum(d[k] for d in deltas) / len(deltas)) for k in keys]
        return [per_worker[0][j].result() for j in range(len(self.fragments[f]))], enc / len(self.comms), link, sent

    @torch.no_grad()
    def _collect(self, f: int) -> Finished:
        """Fragment f's exchange driven to its end (or its result kept by a checkpoint), with the
        link seconds it waited for (sim: modelled; real: the measured wait)."""
        if f in self._inflight:
            results, enc, link, sent = self._finish(f)
        else:
            done = self._results.pop(f)
            results, enc, link, sent = done["results"], 0.0, float(done.get("link", 0.0)), done["bytes"]
        hidden = self._compute_since.pop(f, 0.0) if self.sim else 0.0
        if not self.sim:
            exposed = link
        elif not self.sync.overlap:
            exposed = max(0.0, link - hidden)
        else:  # one link, first in first out: f's bytes start when it was sent or when the link fell idle
            start = min(hidden, self._link_idle)  # seconds ago
            exposed = max(0.0, link - start)
            self._link_idle = max(0.0, start - link)  # f arrived this long ago (0: the compute thread waited)
            for g in self._compute_since:  # the exchanges in flight travel on while the compute thread waits
                self._compute_since[g] += exposed
        return Finished(results, enc, link, exposed, sent)

    @torch.no_grad()
    def _apply(self, f: int, st: SyncStats, done: Finished) -> None:
        """Outer step on fragment f with the averaged pseudo-gradient, then merge into every worker."""
        results = done.results
        st.bytes_sent += done.sent[0]
        st.bytes_recv += done.sent[1]
        st.intra_bytes_sent += done.sent[2]
        st.applied += 1
        st.compress_s += done.compress_s
        st.link_s += done.link_s
        st.exposed_s += done.exposed_s
        t0 = self._now()
        ids = self.fragments[f]
        parts_of = [unflatten(res[0], self.buckets[bi].shapes)
                    if len(res) == 1 and not (self.buckets[bi].compressed and self._per_tensor) else res
                    for bi, res in zip(ids, results)]
        # The same floats as outer.step() + the merge, in one trip to memory (outer_step.py).
        if fusable(self.outer) and all(p.is_contiguous() for p in self.params):
            items = []
            for bi, parts in zip(ids, parts_of):
                b = self.buckets[bi]
                reps = [unflatten(rep[bi], b.shapes) for rep in self.replicas] if self.sim else []
                for j, (p, gv, d) in enumerate(zip(b.params, unflatten(self.global_[bi], b.shapes), parts)):
                    d = (d if d.dtype == p.dtype else d.to(p.dtype)).view(p.shape)
                    items.append((p, gv, d, [r[j] for r in reps] if self.sim else [p.detach()]))
            fused_sgd_step(self.outer, items, self.alpha)
        else:
            self._outer_step(ids, parts_of)
        st.compress_s += self._now() - t0

    def _outer_step(self, ids: list[int], parts_of: list[Any]) -> None:
        """``outer.step()`` on θ_global (its views stand in for the parameters), then the merge."""
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        swapped = []
        for bi, parts in zip(ids, parts_of):
            b = self.buckets[bi]
            for p, gv, d in zip(b.params, unflatten(self.global_[bi], b.shapes), parts):
                swapped.append((p, p.data))
                p.data = gv
                p.grad = (d if d.dtype == p.dtype else d.to(p.dtype)).view(p.shape)
        try:
            self.outer.step()
        finally:
            for p, data in swapped:
                p.data = data
            for p, g in zip(self.params, saved):
                p.grad = g
        self._merge(ids)

    @torch.no_grad()
    def _merge(self, ids: list[int]) -> None:
        """θ_local ← α·θ_local + (1 − α)·θ_global on buckets ``ids`` of every worker here."""
        targets = [[rep[bi] for bi in ids] for rep in self.replicas] if self.sim else \
            [[p for bi in ids for p in self.buckets[bi].params]]
        sources = [self.global_[bi] for bi in ids] if self.sim else \
            [gv for bi in ids for gv in unflatten(self.global_[bi], self.buckets[bi].shapes)]
        for dst in targets:
            for t, g in zip(dst, sources):
                if self.alpha == 0:
                    t.copy_(g)
                else:
                    t.lerp_(g, 1.0 - self.alpha)


class LocalSGD(DiLoCo):
    """Parameter averaging every ``sync_every`` steps: DiLoCo whose outer step is SGD with lr 1 and
    no momentum (the new θ_global is the mean of the workers' θ_local, through the compressor)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator | SimWorld,
                 sync_every: int, compressor: str = "none", **kwargs: Any) -> None:
        outer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        super().__init__(model, optimizer, outer, comm, sync_every, compressor, **kwargs)

