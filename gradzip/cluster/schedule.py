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
class ModelledStep:
    step_s: float
    compute_s: float
    compress_s: float
    comm_s: float
    link_s: float
    backward_end_s: float


def model_step(compute_s: float, buckets: Sequence[BucketTiming]) -> ModelledStep:
    """Run the schedule of the module docstring. ``buckets`` are in index (launch) order."""
    t = 0.0          # compute-thread clock
    engine = 0.0     # compute-thread engine work done so far
    link = 0.0       # when the link becomes free
    ends: list[float] = []
    for b in buckets:
        t = max(t, b.ready_s + engine) + b.compress_s
        engine += b.compress_s
        link = max(t, link) + (b.rounds_s[0] if b.rounds_s else 0.0)
        ends.append(link)
    t = backward_end = max(t, compute_s + engine)
    rnd = [0] * len(buckets)
    pending = list(range(len(buckets)))
    while pending:
        still = []
        for i in pending:
            b = buckets[i]
            t = max(t, ends[i])
            if rnd[i] + 1 < len(b.rounds_s):
                t += b.between_s[rnd[i]] if rnd[i] < len(b.between_s) else 0.0
                rnd[i] += 1
                link = max(t, link) + b.rounds_s[rnd[i]]
                ends[i] = link
                still.append(i)
            else:
                t += b.decode_s
        pending = still
    compress = sum(b.compress_s + sum(b.between_s) + b.decode_s for b in buckets)
    link_s = sum(sum(b.rounds_s) for b in buckets)
    exposed = max(0.0, t - compute_s - compress)
    return ModelledStep(step_s=compute_s + compress + exposed, compute_s=compute_s, compress_s=compress,
                        comm_s=exposed, link_s=link_s, backward_end_s=backward_end)


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
