"""A compressor per bucket: :class:`ChoiceEngine`, the engine the ``auto`` policy steers.

The engine exchanges every compressed bucket with one compressor. A ``ChoiceEngine`` holds several
candidates (each worker its own instance of each, so each keeps its own state) and exchanges
bucket i with the candidate :meth:`ChoiceEngine.assign` gave it; small tensors stay uncompressed,
as always. Everything else is the engine's: hooks, overlap, the non-finite skip, timings.

Switching a bucket keeps error feedback sound. When bucket i moves from candidate A to B:

1. A's worker memory of the bucket (the residual of what A did not send) is taken out of A
   (``A.forget``), on every worker;
2. it is added, once, to the bucket's next gradient before B compresses it, whatever B is: with
   memory (B then keeps what it does not send in its own memory) or without (``none``, ``fp16``:
   the residual is sent in full).

So no residual is lost or counted twice: over any run, what the workers sent plus what their
memories hold equals the sum of their gradients, across switches. A step that is skipped (inf/NaN
on some rank) also puts back the residual it had taken. ``twophase`` is not supported by
switching (a chunk's server memory belongs to one rank). Under the hierarchical exchange a
worker's memory is that of its shard of the node's mean (a node leader's: the whole bucket's, for
PowerSGD); it moves to the next local gradient at the shard's place, times the ranks per node, so
that the node's mean carries it once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from gradzip.comm.base import Communicator
from gradzip.comm.sim import SimWorld
from gradzip.compress.base import Compressor
from gradzip.compress.registry import create
from gradzip.engine.config import EngineConfig
from gradzip.engine.engine import Engine
from gradzip.engine.startup import scheme_for
from gradzip.engine.worker import _Worker
from gradzip.errors import GradzipError
from gradzip.plan.buckets import Bucket


def _canonical(spec: str) -> str:
    try:
        return create(spec).spec
    except GradzipError:
        return spec


class _Choice:
    """One worker's candidates, their schemes, and the residuals waiting for a bucket's next step.
    It is one of the worker's stateful parts: a skipped step puts back the residuals it took."""

    def __init__(self, w: _Worker, specs: tuple[str, ...], scheme_for: Callable[[Compressor, Any], Any]) -> None:
        self.candidates: dict[str, Compressor] = {}
        self.schemes: dict[str, Any] = {}  # SchemeState, or HierarchicalScheme
        for spec in specs:
            if spec == w.compressor.spec:  # the engine's own compressor is this candidate
                self.candidates[spec], self.schemes[spec] = w.compressor, w.scheme
            else:
                self.candidates[spec] = c = create(spec)
                self.schemes[spec] = scheme_for(c, w.comm)
        self.pending: dict[str, Tensor] = {}
        self._taken: dict[str, Tensor] | None = None

    def stateful(self) -> list[Any]:
        out: list[Any] = [self]
        for spec, c in self.candidates.items():
            out += [c, *self.schemes[spec].compressors()]
        return out

    def take(self, key: str) -> Tensor | None:
        r = self.pending.pop(key, None)
        if r is not None and self._taken is not None:
            self._taken[key] = r
        return r

    def begin_step(self) -> None:
        self._taken = {}

    def end_step(self, keep: bool) -> None:
        taken, self._taken = self._taken, None
        if not keep and taken:
            self.pending.update(taken)

    def state_dict(self) -> dict[str, Any]:
        return {"pending": {k: v.clone() for k, v in self.pending.items()},
                "candidates": {s: c.state_dict() for s, c in self.candidates.items()},
                "schemes": {s: sc.state_dict() for s, sc in self.schemes.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = {str(k): v.clone() for k, v in state.get("pending", {}).items()}
        for s, sd in state.get("candidates", {}).items():
            self.candidates[s].load_state_dict(sd)
        for s, sd in state.get("schemes", {}).items():
            self.schemes[s].load_state_dict(sd)


class ChoiceEngine(Engine):
    """The engine with a candidate per bucket (module docstring). ``candidates``: compressor specs,
    the first the initial choice of every bucket."""

    def __init__(self, model: torch.nn.Module, candidates: tuple[str, ...] | list[str], comm: Communicator | SimWorld,
                 config: EngineConfig | None = None) -> None:
        if not candidates:
            raise GradzipError("ChoiceEngine: give at least one candidate compressor spec")
        comps = [create(c) for c in candidates]
        bad = [c.spec for c in comps if c.exchange == "twophase"]
        if bad:
            raise GradzipError(f"candidate {bad[0]!r}: twophase keeps server memory per rank, which cannot follow a "
                               "bucket to another compressor; use its own collective (drop exchange=twophase)")
        # Small tensors apart (as for any compressor but none), whichever candidate comes first.
        base = next((c for c in comps if not c.identity), comps[0])
        super().__init__(model, base, comm, config)
        self.candidates = tuple(c.spec for c in comps)
        self.assigned = [self.candidates[0]] * len(self.buckets)
        # Each worker's candidates, by worker id: this engine's own state, beside its workers.
        # Hierarchical schemes split the communicator: every worker's first, then bind.
        self._choices: dict[int, _Choice] = {w.id: _Choice(w, self.candidates, self._scheme_for)
                                             for w in self._workers}
        for w in self._workers:
            ch = self._choices[w.id]
            for scheme in ch.schemes.values():
                scheme.bind()
            w.stateful = list(dict.fromkeys([*w.stateful, *ch.stateful()]))

    def _scheme_for(self, c: Compressor, comm: Any) -> Any:
        """Each candidate's scheme, picked as the start-up picks the engine's (:func:`scheme_for`)."""
        return scheme_for(c, comm, self.config.hierarchical, self.config.intra_dtype)

    def _select(self, w: _Worker, b: Bucket) -> tuple[Compressor, Any]:
        if not (b.compressed and self.compressing):
            return self._plain, w.scheme
        spec, ch = self.assigned[b.index], self._choices[w.id]
        residual = ch.take(b.key)
        if residual is not None:  # moved here from the bucket's previous compressor: sent from now on
            w.buffer(b).add_(residual.to(b.dtype))
        return ch.candidates[spec], ch.schemes[spec]

    def assign(self, index: int, spec: str) -> None:
        """Exchange bucket ``index`` with candidate ``spec`` from the next step on (between steps,
        on every rank alike). Its error memory under the old candidate moves to its next gradient."""
        spec = spec if spec in self.candidates else _canonical(spec)
        if spec not in self.candidates:
            raise GradzipError(f"{spec!r} is not one of the candidates {', '.join(self.candidates)}")
        old, b = self.assigned[index], self.buckets[index]
        if old == spec:
            return
        for w in self._workers:
            self._settle(w, keep=True)  # the last step is kept: its memory is what moves
            ch = self._choices[w.id]
            r = ch.schemes[old].residual(b.key, b.numel)
            r = None if r is None else r.detach().float().clone()
            ch.schemes[old].forget(b.key)
            if r is not None:
                prev = ch.pending.get(b.key)
                ch.pending[b.key] = r if prev is None else prev + r
        self.assigned[index] = spec

    def memory(self, wid: int, index: int) -> Tensor:
        """Worker ``wid``'s whole residual of bucket ``index``: its candidate's memory plus what waits
        to be added to the next gradient (fp32, flat; zeros when there is none)."""
        w, b = self._lookup(wid), self.buckets[index]
        self._settle(w, keep=True)  # the last step's memory, kept
        ch = self._choices[w.id]
        out = torch.zeros(b.numel, dtype=torch.float32, device=b.device)
        r = ch.schemes[self.assigned[index]].residual(b.key, b.numel)
        if r is not None:
            out += r.float()
        if b.key in ch.pending:
            out += ch.pending[b.key]
        return out

    # ------------------------------------------------------------------ for the policy that steers it
    @property
    def topology(self) -> Any:
        """Under the hierarchical exchange: the first worker's groups (``node``, ``cross``,
        ``local_rank``, ``ranks_per_node``); None otherwise."""
        return self._workers[0].scheme.topo if self.config.hierarchical else None

    def work_time(self) -> float:
        """The engine's clock for local work (wall time, or sim's CPU time)."""
        return self._now()

    def bytes_sent(self) -> float:
        """Bytes sent so far, mean over this process's workers (a running total)."""
        return sum(w.comm.stats.bytes_sent for w in self._workers) / len(self._workers)

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[dict[str, float]]:
        """Traffic between two steps that belongs to the one just ended (the auto policy's probes
        and agreements): on exit the yielded dict holds its ``bytes_sent``, ``bytes_recv`` and
        ``intra_bytes_sent`` (mean over workers), which are taken out of the next step's count."""
        snaps = [w.comm.stats.snapshot() for w in self._workers]
        out = {"bytes_sent": 0.0, "bytes_recv": 0.0, "intra_bytes_sent": 0.0}
        try:
            yield out
        finally:
            for w, snap in zip(self._workers, snaps):
                d = w.comm.stats.since(snap)
                for k in out:
                    out[k] += d[k] / len(self._workers)
                # the next step counts from where it would have, plus this traffic
                w.snap = (w.snap[0] + int(d["bytes_sent"]), w.snap[1] + int(d["bytes_recv"]), w.snap[2] + d["seconds"],
                          w.snap[3] + int(d["calls"]), w.snap[4] + int(d["intra_bytes_sent"]))

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["assigned"] = list(self.assigned)
        sd["choices"] = [self._choices[w.id].state_dict() for w in self._workers]
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        assigned = list(state.get("assigned", self.assigned))
        if len(assigned) != len(self.buckets) or set(assigned) - set(self.candidates):
            raise GradzipError("engine state: the per-bucket choice does not fit these buckets and candidates")
        self.assigned = assigned
        for w, sd in zip(self._workers, state.get("choices", [])):
            self._choices[w.id].load_state_dict(sd)
