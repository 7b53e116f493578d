"""The one step-time model: how buckets, encoding and a serial link make up a data-parallel step.

Used by the ``sim`` backend's virtual clock (the engine), by ``gradzip simulate`` (the cluster
cost model), by its validation and by the engine benchmark: every modelled step time in gradzip
comes from :func:`model_step`, so they all share one overlap rule. ``gradzip simulate`` builds
the per-bucket inputs below from its α–β cost model instead of measuring them.

The virtual clock charges a step as N parallel workers running this engine would experience it.
Its inputs are, per bucket in launch (index) order, averaged over the simulated workers (they all
ran on this one CPU, one after the other):

- ``ready_s``: the *pure compute* offset into forward+backward at which the bucket launched
  (wall offset minus the engine's own time spent so far on that worker);
- ``compress_s``: compute-thread time to pack the bucket and encode round 0;
- ``rounds_s``: the modelled α–β link time of each communication round (from the ``sim``
  collectives: ring formulas of :mod:`gradzip.comm.cost`; a round with several payload tensors
  is the sum of their collectives);
- ``between_s``: compute-thread time between rounds (PowerSGD: orthogonalise, next factor);
- ``decode_s``: compute-thread time to decode the last round and write ``.grad``;

and ``compute_s``, the measured forward+backward of one worker (mean over workers).

Model (the engine's own schedule, one compute thread and one serial link per worker):

1. Backward runs; encoding happens on the compute thread, so it delays the rest of backward.
   Bucket i launches round 0 at ``t_i = max(t_{i-1}, ready_i + Σ_{j<i} compress_j) + compress_i``.
2. The link is serial and FIFO: ``start = max(launch, link_free)``, ``end = start + round_s``.
3. Backward (plus encoding) ends at ``B = max(t_last, compute + Σ compress)``; ``finalize()``
   then works in waves over the buckets in index order: wait for the bucket's current round,
   then either compute and launch its next round, or decode it.
4. ``step_s`` is when the last decode ends; ``compress_s`` is all compute-thread engine work;
   exposed communication is ``comm_s = step_s − compute_s − compress_s`` (time the compute
   thread waits on the link, never negative). For one-round compressors this is
   ``max(0, end_last − B)`` plus the decode waits of the tail.

The schedule itself comes back as :class:`Span` s (``ModelledStep.spans``): on the compute
thread, backward, each bucket's encode, the waits for the link, the work between rounds and the
decodes; on the link, each round in flight. ``gradzip train`` writes one step's spans to
``schedule.json`` and ``gradzip plot`` draws them (figure ``schedule``); real backends record
the same spans from measured timestamps (:func:`measured_spans`).

What it ignores, on purpose: stragglers (means, not maxima, over workers), contention between
compression kernels and communication for memory bandwidth, and the optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class BucketTiming:
    """One bucket's timing inputs to :func:`model_step` (see the module docstring)."""

    ready_s: float
    compress_s: float
    rounds_s: list[float] = field(default_factory=list)
    between_s: list[float] = field(default_factory=list)
    decode_s: float = 0.0


@dataclass
class Span:
    """One interval of a step's schedule, in seconds from the start of forward.

    lane: ``"compute"`` (the worker's one compute thread) or ``"link"`` (its serial link).
    kind: on the compute thread ``"backward"`` (forward and backward, between the encodes),
        ``"encode"`` (pack + round 0's compression), ``"wait"`` (blocked on the link),
        ``"between"`` (work between rounds: PowerSGD's next factor), ``"decode"`` (decode the last
        round, write ``.grad``); on the link ``"round"`` (a round's collectives in flight; on real
        backends from launch to the end of the wait, an upper bound of the transfer).
    """

    lane: str
    kind: str
    start: float
    end: float
    bucket: int | None = None
    round: int | None = None

    def to_dict(self) -> dict[str, object]:
        return {"lane": self.lane, "kind": self.kind, "start": self.start, "end": self.end,
                "bucket": self.bucket, "round": self.round}


def _add(spans: list[Span], lane: str, kind: str, start: float, end: float,
         bucket: int | None = None, rnd: int | None = None) -> None:
    if end > start:
        spans.append(Span(lane, kind, start, end, bucket, rnd))


def backward_spans(encodes: Sequence[Span], backward_end: float) -> list[Span]:
    """The compute thread's backward: the part of [0, backward_end] that no encode occupies."""
    out: list[Span] = []
    t = 0.0
    for e in sorted(encodes, key=lambda s: s.start):
        _add(out, "compute", "backward", t, e.start)
        t = max(t, e.end)
    _add(out, "compute", "backward", t, backward_end)
    return out


Mark = tuple[str, str, float, float, "int | None", "int | None"]  # lane, kind, start, end, bucket, round


def measured_spans(marks: Sequence[Mark], origin: float, backward_end: float) -> list[Span]:
    """A real backend's schedule: ``marks`` with absolute ``perf_counter`` times, made relative to
    ``origin`` (the start of forward); backward fills the compute thread up to ``backward_end``
    (relative) wherever no encode ran."""
    spans: list[Span] = []
    for lane, kind, start, end, bucket, rnd in marks:
        _add(spans, lane, kind, start - origin, end - origin, bucket, rnd)
    return backward_spans([s for s in spans if s.kind == "encode"], backward_end) + spans


@dataclass
class ModelledStep:
    step_s: float
    compute_s: float
    compress_s: float
    comm_s: float
    link_s: float
    backward_end_s: float
    spans: list[Span] = field(default_factory=list)


def model_step(compute_s: float, buckets: Sequence[BucketTiming]) -> ModelledStep:
    """Run the schedule of the module docstring. ``buckets`` are in index (launch) order."""
    t = 0.0          # compute-thread clock
    engine = 0.0     # compute-thread engine work done so far
    link = 0.0       # when the link becomes free
    ends: list[float] = []
    spans: list[Span] = []
    for i, b in enumerate(buckets):
        start = max(t, b.ready_s + engine)  # (not t - compress_s: that can round away a tiny start)
        t = start + b.compress_s
        engine += b.compress_s
        _add(spans, "compute", "encode", start, t, i)
        r0 = b.rounds_s[0] if b.rounds_s else 0.0
        _add(spans, "link", "round", max(t, link), max(t, link) + r0, i, 0)
        link = max(t, link) + r0
        ends.append(link)
    t = backward_end = max(t, compute_s + engine)
    spans = backward_spans([s for s in spans if s.kind == "encode"], backward_end) + spans
    rnd = [0] * len(buckets)
    pending = list(range(len(buckets)))
    while pending:
        still = []
        for i in pending:
            b = buckets[i]
            _add(spans, "compute", "wait", t, ends[i], i, rnd[i])
            t = max(t, ends[i])
            if rnd[i] + 1 < len(b.rounds_s):
                between = b.between_s[rnd[i]] if rnd[i] < len(b.between_s) else 0.0
                _add(spans, "compute", "between", t, t + between, i, rnd[i])
                t += between
                rnd[i] += 1
                _add(spans, "link", "round", max(t, link), max(t, link) + b.rounds_s[rnd[i]], i, rnd[i])
                link = max(t, link) + b.rounds_s[rnd[i]]
                ends[i] = link
                still.append(i)
            else:
                _add(spans, "compute", "decode", t, t + b.decode_s, i)
                t += b.decode_s
        pending = still
    compress = sum(b.compress_s + sum(b.between_s) + b.decode_s for b in buckets)
    link_s = sum(sum(b.rounds_s) for b in buckets)
    exposed = max(0.0, t - compute_s - compress)
    return ModelledStep(step_s=compute_s + compress + exposed, compute_s=compute_s, compress_s=compress,
                        comm_s=exposed, link_s=link_s, backward_end_s=backward_end, spans=spans)


def mean_timings(per_worker: Sequence[Sequence[BucketTiming]]) -> list[BucketTiming]:
    """Field-wise mean over workers of their per-bucket timings (rounds_s are identical)."""
    n = len(per_worker)
    out = []
    for parts in zip(*per_worker):
        rounds = max(len(p.between_s) for p in parts)
        out.append(BucketTiming(
            ready_s=sum(p.ready_s for p in parts) / n,
            compress_s=sum(p.compress_s for p in parts) / n,
            rounds_s=list(parts[0].rounds_s),
            between_s=[sum(p.between_s[r] for p in parts if r < len(p.between_s)) / n for r in range(rounds)],
            decode_s=sum(p.decode_s for p in parts) / n,
        ))
    return out
