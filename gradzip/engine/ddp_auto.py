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
   point): the link (:func:`gradzip.engine.auto_measure.probe_link`, timed allreduces), each
   candidate's encode + decode time on the step's buckets, and compute (the time between two
   steps less what the hook spent exposed); the mean of each over the ranks.
3. **Plan** per bucket (:func:`gradzip.engine.auto_measure.make_plan`; a bucket's small tensors
   always go uncompressed) and apply it from the next step.
4. **Watch**: each step's exposed communication (hook time less encode/decode) against the
   prediction, the ranks' mean gap; off by more than ``tolerance`` of the predicted step for
   ``patience`` steps, or every ``replan_every`` steps: measure and plan again.

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

from gradzip.cluster.network import CodecCost
from gradzip.cluster.simulate import BucketShape
from gradzip.compress.registry import create
from gradzip.engine.auto_measure import (
    PolicyLog,
    agree,
    dtype_name,
    make_plan,
    plan_record,
    policy_summary,
    probe_link,
    time_codecs,
)
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
        self.steps, self.planned_at, self.drift = 0, -1, 0
        self.prediction: dict[str, float] = {}
        self.plans: list[dict[str, Any]] = []
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
        self.steps += 1
        self._policy(shapes, comm_s, compute_s)
        self._last_end = time.perf_counter()  # the policy's own time is not the next step's compute

    def _policy(self, shapes: list[tuple[str, BucketShape]], comm_s: float, compute_s: float | None) -> None:
        if compute_s is None:  # the first step of a process: the last plan's compute stands in
            compute_s = self.prediction.get("compute_s")
        if self.steps < max(self.auto.warmup, 2) or compute_s is None:
            return
        if self.planned_at < 0:
            why = "first plan" if self.auto.warmup <= 2 else f"after {self.auto.warmup} warm-up steps"
            self.replan(shapes, comm_s, compute_s, why)
            return
        gap = self._collective(lambda: agree(self.comm, self.comm.world_size,
                                             [abs(comm_s - self.prediction["comm_s"])], self._device))[0]
        self.drift = self.drift + 1 if gap > self.auto.tolerance * self.prediction["step_s"] else 0
        if self.drift >= self.auto.patience:
            self.replan(shapes, comm_s, compute_s, f"measured communication off the prediction for {self.drift} steps")
        elif self.auto.replan_every and self.steps - self.planned_at >= self.auto.replan_every:
            self.replan(shapes, comm_s, compute_s, f"every {self.auto.replan_every} steps")

    def _collective(self, fn: Any) -> Any:
        """Run the policy's own collectives; their bytes are the policy's, not a step's (``stats()``)."""
        sent0 = self.comm.stats.bytes_sent
        out = fn()
        self._bytes_mark += self.comm.stats.bytes_sent - sent0
        return out

    def replan(self, shapes: list[tuple[str, BucketShape]], comm_s: float, compute_s: float, reason: str) -> None:
        """Measure, agree, plan ``shapes`` (this step's buckets) and assign from the next step on."""
        n, sent0 = self.comm.world_size, self.comm.stats.bytes_sent
        latency, bandwidth = self._collective(lambda: probe_link(self.comm, n, self._device))
        sizes = [(b.numel, [torch.Size(s) for s in b.shapes]) for _, b in shapes if b.compressed]
        codecs = time_codecs(self.candidates, sizes, self._device)
        specs = [s for s in self.candidates if s != "none"]
        agreed = self._collective(lambda: agree(self.comm, n, [latency, 1.0 / bandwidth, compute_s,
                                                               *(codecs[s].encode_s for s in specs)], self._device))
        latency, bandwidth, compute = agreed[0], 1.0 / max(agreed[1], 1e-18), max(agreed[2], 1e-9)
        codecs.update({s: CodecCost(v, 0.0, "measured") for s, v in zip(specs, agreed[3:])})
        p = make_plan(self.auto, tuple(b for _, b in shapes), n, latency, bandwidth, compute, codecs, self._dtype)
        for (key, b), choice in zip(shapes, p.choice):
            if b.compressed:
                self.assign(key, choice)
        self.planned_at, self.drift = self.steps, 0
        self.prediction = {"step_s": p.step_s, "comm_s": p.comm_s, "compute_s": compute}
        self.plans.append({"step": self.steps, "reason": reason, "none_is_best": p.none_is_best})
        self.log.append(plan_record(self.steps, reason, latency, bandwidth, self.comm.stats.bytes_sent - sent0,
                                    compute, p, comm_s))

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
    def summary(self) -> dict[str, Any]:
        """The ``auto_*`` fields of :meth:`gradzip.engine.auto.AutoEngine.summary`, for this hook."""
        return policy_summary(list(self.assigned.values()), self.plans)

    def state_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "candidates": {c: st.state_dict() for c, st in self.inner.items()},
                "pending": {str(o): t.clone() for o, t in self.pending.items()},
                "auto": {"steps": self.steps, "planned_at": self.planned_at, "drift": self.drift,
                         "prediction": dict(self.prediction), "plans": list(self.plans),
                         "assigned": dict(self.assigned)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("spec") != self.spec or "auto" not in state:
            raise GradzipError(f"hook state is for compressor {state.get('spec')!r}, not {self.spec!r}")
        for c, st in self.inner.items():
            st.load_state_dict(state["candidates"][c])
        self.pending = {int(o): t for o, t in state.get("pending", {}).items()}
        a = state["auto"]
        self.steps, self.planned_at, self.drift = int(a["steps"]), int(a["planned_at"]), int(a["drift"])
        self.prediction, self.plans, self.assigned = dict(a["prediction"]), list(a["plans"]), dict(a["assigned"])
        self._cut = self.steps  # policy.jsonl loses the plans made after the checkpoint (when bound)
        if self.comm is not None:
            self.log.cut_after(self.steps)
