"""``gradzip.ddp_hook("auto")``: the ``auto`` policy as a ``DistributedDataParallel`` comm hook.

Example (every rank)::

    state, hook = gradzip.ddp_hook("auto:candidates=none/fp16/powersgd:rank=4", log="policy.jsonl")
    ddp.register_comm_hook(state, hook)
    ...
    print(state.summary())

The hook is :func:`gradzip.engine.ddp.gradzip_comm_hook` with an :class:`AutoHookState`: one
:class:`~gradzip.engine.ddp.GradzipHookState` per candidate (each with its own error memory and
scheme, on the one communicator) and, per DDP bucket, the candidate that exchanges it. Steps
(a step = the hook's last bucket of an iteration, so accumulation steps under ``no_sync`` are not
counted):

1. **Uncompressed first steps**: every bucket goes with ``none`` for ``max(warmup, 2)`` steps.
   DDP's first iteration uses its initial buckets and rebuilds them after it; the plan is for the
   rebuilt ones.
2. **Measure** at the end of that step (in the last bucket's hook call, on every rank at the same
   point): the link (:func:`gradzip.auto.measure.probe_link`, timed allreduces), each
   candidate's encode + decode time on the step's buckets, and compute (the time between two
   steps less what the hook spent exposed); the mean of each over the ranks.
3. **Plan** per bucket (:func:`gradzip.auto.measure.make_plan`; a bucket's small tensors
   always go uncompressed) and apply it from the next step.
4. **Watch**: each step's exposed communication (hook time less encode/decode) against the
   prediction, the ranks' mean gap, by the engine's rule (:class:`gradzip.auto.watch.PolicyWatch`):
   off by more than ``tolerance`` of the predicted step and the host's noise for ``patience``
   steps, probe the link again (the codec timings kept); every ``replan_every`` steps, measure
   everything and plan again.

The policy's own collectives (probes, agreements) are a part of the bytes :meth:`stats` reports,
and of its compression ratio; ``probe_bytes_per_step`` shows them apart, ``summary()``'s
``auto_probe_bytes`` in all.

Switching a bucket moves its error memory soundly: the old candidate's residual of each
parameter is taken out of it and added, once, to that parameter's next gradient, whatever the new
candidate is. The same happens when a bucket with a new layout appears (a DDP rebuild): the memory
of its parameters leaves the buckets that held them. Plans are lines of ``log`` (rank 0), the
fields of :mod:`gradzip.engine.auto`'s ``policy.jsonl``. ``state_dict()`` holds every candidate's
state, the plan and the counters; after a restart, DDP's first iteration uses its initial buckets,
which have no plan: they go uncompressed, with their parameters' memory added, and the saved plan
applies again from the rebuilt buckets on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gradzip.auto.measure import agree, dtype_name, make_plan, probe_link, time_codecs
from gradzip.auto.record import PolicyLog, plan_record, policy_summary
from gradzip.auto.watch import PolicyWatch, Replan
from gradzip.cluster.network import CodecCost
from gradzip.cluster.simulate import BucketShape
from gradzip.compress.registry import create
from gradzip.engine.choice import _canonical
from gradzip.engine.ddp import GradzipHookState, _Part
from gradzip.errors import GradzipError
from gradzip.plan.auto import parse_auto


class AutoHookState(GradzipHookState):
    """The state of ``gradzip.ddp_hook("auto...")`` (module docstring). ``log``: ``policy.jsonl``'s
    path, written by rank 0 (None: not written)."""

    def __init__(self, spec: str, comm: Any = None, min_compress_numel: int = 1024, timeout: float | None = None,
                 log: str | Path | None = None) -> None:
        self.auto = parse_auto(spec)  # a bad spec fails here, before any collective
        super().__init__("none", None, min_compress_numel, timeout)
        self.spec = self.auto.spec
        self.candidates = tuple(dict.fromkeys(("none", *self.auto.allowed)))
        self._canon = {create(c).spec: c for c in self.candidates}  # canonical spec -> the user's spelling
        self.inner = {c: GradzipHookState(c, None, min_compress_numel, timeout) for c in self.candidates}
        self._log_path, self.log = log, PolicyLog(None)
        self.assigned: dict[str, str] = {}     # bucket key -> candidate (unplanned keys: none)
        self.pending: dict[int, Tensor] = {}   # parameter ordinal -> residual for its next gradient
        self.watch = PolicyWatch(self.auto, min_steps=2)  # DDP rebuilds its buckets after the first step
        self._probe_since = 0                  # the policy's bytes since the last stats()
        self._seen: set[str] = set()           # keys met in this process
        self._round: list[tuple[str, BucketShape]] = []  # this step's buckets, in call order
        self._device: torch.device = torch.device("cpu")
        self._dtype = "fp32"
        self._launch_s, self._last_end, self._cut = 0.0, None, -1
        if comm is not None:
            self._attach(comm)

    def _attach(self, comm: Any) -> None:
        super()._attach(comm)
        for st in self.inner.values():
            st._attach(comm)
        self.log = PolicyLog(self._log_path if comm.rank == 0 else None)
        if self._cut >= 0:
            self.log.cut_after(self._cut)

    # -- the step ----------------------------------------------------------------------------
    def start(self, key: str, buffer: Tensor, grads: list[Tensor],
              layout: tuple[int, ...] | None = None) -> list[_Part]:
        t0 = time.perf_counter()
        if layout is not None and key not in self._seen:
            self._seen.add(key)
            for st in self.inner.values():  # a new layout: its parameters' memory leaves the old buckets
                # (the same key is the same layout: a resumed run meets its saved keys again)
                for old in [k for k, (ords, _) in st._members.items() if k != key and set(ords) & set(layout)]:
                    self._evacuate(st, old)
        if layout is not None and self.pending:
            for g, o in zip(grads, layout):
                r = self.pending.pop(o, None)
                if r is not None:
                    g.add_(r.view_as(g).to(g.dtype))
        big = [g for g in grads if g.numel() >= self.min_compress_numel]
        small = [g for g in grads if 0 < g.numel() < self.min_compress_numel]
        for part, compressed in ((big, True), (small, False)):
            if part:
                self._round.append((key if compressed else "", BucketShape(
                    tuple(tuple(g.shape) for g in part), sum(g.numel() for g in part), compressed)))
        self._device, self._dtype = buffer.device, dtype_name(buffer.dtype)
        n = self.comm.world_size
        self._totals["plain_bytes"] += 4 * sum(g.numel() for g in grads) * 2 * (n - 1) / n
        parts = self.inner[self.assigned.get(key, "none")].start(key, buffer, grads, layout)
        self._launch_s += time.perf_counter() - t0
        return parts

    def drain(self) -> None:
        t0, codec0 = time.perf_counter(), self._totals["compress_s"]
        super().drain()
        t1 = time.perf_counter()
        exposed = t1 - t0 + self._launch_s
        comm_s = max(exposed - (self._totals["compress_s"] - codec0), 0.0)
        compute_s = None if self._last_end is None else max(t1 - self._last_end - exposed, 1e-9)
        shapes, self._round, self._launch_s = self._round, [], 0.0
        self.watch.step()
        self._policy(shapes, comm_s, compute_s)
        self._last_end = time.perf_counter()  # the policy's own time is not the next step's compute

    def _policy(self, shapes: list[tuple[str, BucketShape]], comm_s: float, compute_s: float | None) -> None:
        if compute_s is None:  # the first step of a process: the last plan's compute stands in
            compute_s = self.watch.prediction.get("compute_s")
        if compute_s is None:
            return
        n = self.comm.world_size
        replan = self.watch.check(comm_s, lambda gap: self._collective(
            lambda: agree(self.comm, n, [gap], self._device))[0])
        if replan is not None:
            self.replan(shapes, comm_s, compute_s, replan)

    def _collective(self, fn: Any) -> Any:
        """Run the policy's own collectives; their bytes are the policy's (``probe_bytes``), and
        a part of what ``stats()`` reports sent."""
        sent0 = self.comm.stats.bytes_sent
        out = fn()
        sent = self.comm.stats.bytes_sent - sent0
        self.watch.probe_bytes += sent
        self._probe_since += sent
        return out

    def replan(self, shapes: list[tuple[str, BucketShape]], comm_s: float, compute_s: float,
               why: Replan | str) -> None:
        """Measure, agree, plan ``shapes`` (this step's buckets) and assign from the next step on
        (a link-only re-plan keeps the codec timings measured on the same buckets)."""
        why = why if isinstance(why, Replan) else Replan(why)
        n, sent0 = self.comm.world_size, self.comm.stats.bytes_sent
        link = self._collective(lambda: probe_link(self.comm, n, self._device))
        key = tuple((b.numel, b.shapes) for _, b in shapes if b.compressed)
        kept = self.watch.codecs(why, key)
        codecs = kept if kept is not None else time_codecs(
            self.candidates, [(numel, [torch.Size(s) for s in shp]) for numel, shp in key], self._device)
        specs = [s for s in self.candidates if s != "none"]
        agreed = self._collective(lambda: agree(self.comm, n, [link.latency_s, 1.0 / link.bandwidth_bps, compute_s,
                                                               link.noise, *(codecs[s].encode_s for s in specs)],
                                                self._device))
        latency, bandwidth, compute = agreed[0], 1.0 / max(agreed[1], 1e-18), max(agreed[2], 1e-9)
        codecs.update({s: CodecCost(v, 0.0, "measured") for s, v in zip(specs, agreed[4:])})
        p = make_plan(self.auto, tuple(b for _, b in shapes), n, latency, bandwidth, compute, codecs, self._dtype)
        for (bucket, b), choice in zip(shapes, p.choice):
            if b.compressed:
                self.assign(bucket, choice)
        self.watch.planned(why.reason, p, agreed[3], key, codecs, compute_s=compute)
        rec = plan_record(self.watch.steps, why.reason, latency, bandwidth, self.comm.stats.bytes_sent - sent0,
                          compute, p, comm_s)
        rec.update(noise=agreed[3], codecs_reused=kept is not None)
        self.log.append(rec)

    # -- switching ---------------------------------------------------------------------------
    def assign(self, key: str, spec: str) -> None:
        """Exchange bucket ``key`` with candidate ``spec`` from its next call on (every rank alike);
        its memory under the old candidate goes to its parameters' next gradients."""
        spec = spec if spec in self.inner else self._canon.get(_canonical(spec), spec)
        if spec not in self.inner:
            raise GradzipError(f"{spec!r} is not one of the candidates {', '.join(self.candidates)}")
        old = self.assigned.get(key, "none")
        if old != spec and key in self.inner[old]._members:
            self._evacuate(self.inner[old], key)
        self.assigned[key] = spec

    @torch.no_grad()
    def _evacuate(self, st: GradzipHookState, key: str) -> None:
        ords, numels = st._members.pop(key)
        res = st.scheme.residual(key, sum(numels))
        st.scheme.forget(key)
        for o in ords:
            if st._owner.get(o) == key:
                del st._owner[o]
        if res is not None:
            for o, piece in zip(ords, torch.split(res.detach().float().reshape(-1), numels)):
                prev = self.pending.get(o)
                self.pending[o] = piece.clone() if prev is None else prev + piece

    def memory(self, ordinal: int) -> Tensor | None:
        """Parameter ``ordinal``'s whole residual, flat fp32: its candidate's memory plus what waits
        for its next gradient (None: none)."""
        out = self.pending.get(ordinal)
        for st in self.inner.values():
            key = st._owner.get(ordinal)
            if key is None:
                continue
            ords, numels = st._members[key]
            res = st.scheme.residual(key, sum(numels))
            if res is not None:
                piece = torch.split(res.detach().float().reshape(-1), numels)[ords.index(ordinal)]
                out = piece.clone() if out is None else out + piece
        return out

    # -- reports and checkpoints ------------------------------------------------------------
    @property
    def steps(self) -> int:
        return self.watch.steps

    @property
    def planned_at(self) -> int:
        return self.watch.planned_at

    @property
    def plans(self) -> list[dict[str, Any]]:
        return self.watch.plans

    def stats(self, reset: bool = True) -> dict[str, float]:
        """:meth:`GradzipHookState.stats`, whose bytes include the policy's own collectives, and
        ``probe_bytes_per_step``: that part of them."""
        out = super().stats(reset)
        probe, self._probe_since = self._probe_since, 0 if reset else self._probe_since
        if out:
            out["probe_bytes_per_step"] = probe / out["steps"]
        return out

    def summary(self) -> dict[str, Any]:
        """The ``auto_*`` fields of :meth:`gradzip.engine.auto.AutoEngine.summary`, for this hook."""
        return policy_summary(list(self.assigned.values()), self.watch.plans, self.watch.probe_bytes)

    def state_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "candidates": {c: st.state_dict() for c, st in self.inner.items()},
                "pending": {str(o): t.clone() for o, t in self.pending.items()},
                "auto": {**self.watch.state_dict(), "assigned": dict(self.assigned)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("spec") != self.spec or "auto" not in state:
            raise GradzipError(f"hook state is for compressor {state.get('spec')!r}, not {self.spec!r}")
        for c, st in self.inner.items():
            st.load_state_dict(state["candidates"][c])
        self.pending = {int(o): t for o, t in state.get("pending", {}).items()}
        a = state["auto"]
        self.watch.load_state_dict(a)
        self.assigned = dict(a["assigned"])
        self._cut = self.steps  # policy.jsonl loses the plans made after the checkpoint (when bound)
        if self.comm is not None:
            self.log.cut_after(self.steps)
