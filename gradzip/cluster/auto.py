"""The ``auto`` policy's plan: per bucket, the candidate that minimises the predicted step time.

Inputs: the engine's buckets (the model's parameter shapes, bucketed as the engine buckets them,
small tensors apart), the link (a :class:`gradzip.cluster.network.Cluster`: measured at run time by
the probe, or given to ``gradzip simulate``), and each candidate's encode/decode cost per element
(:class:`CodecCost`: timed on the actual buckets at run time, or from ``--encode-cost``).

1. Each candidate's timing of each bucket: its own collective or declared scheme
   (:mod:`gradzip.cluster.exchanges`), ready when backward has produced the bucket's gradients.
2. Start from the best single candidate for every bucket (what the fixed policies would do).
3. Coordinate descent: for each bucket in turn, try every allowed candidate and keep the one with
   the lowest predicted step of the whole schedule (:func:`gradzip.cluster.schedule.model_step`:
   overlap with backward and the serial link included), until a pass changes nothing.
4. Ties (within 0.1% of the step) go to the candidate earlier in the quality order: a bucket whose
   transfer backward hides anyway stays uncompressed.

Plain buckets (small tensors) always go uncompressed, as in the engine. Every rank computes the
same plan from the same (allreduced) measurements. :attr:`AutoPlan.none_is_best` says when no
candidate beats ``none``: the policy then says so instead of compressing silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gradzip.cluster.exchanges import flat_bucket, hierarchical_bucket
from gradzip.cluster.network import Cluster, CodecCost
from gradzip.cluster.schedule import BucketTiming, model_step
from gradzip.cluster.simulate import DTYPES, BucketShape, Workload, model_buckets, ready_times
from gradzip.compress.registry import create
from gradzip.plan.auto import AutoSpec

TIE = 1e-3  # relative: a step this close to the best counts as equal, and quality decides


@dataclass
class AutoPlan:
    """One plan: ``choice[i]`` is bucket i's candidate (``"none"`` for plain buckets)."""

    choice: list[str]
    step_s: float               # predicted step of the plan
    comm_s: float               # predicted exposed communication
    link_s: float               # predicted time on the link, overlapped or not
    compute_s: float
    fixed: dict[str, float] = field(default_factory=dict)  # each allowed candidate alone: predicted step
    numels: list[int] = field(default_factory=list)

    @property
    def none_is_best(self) -> bool:
        """No bucket compressed: every candidate was predicted no faster than ``none``."""
        return all(c == "none" for c in self.choice)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.choice:
            out[c] = out.get(c, 0) + 1
        return out


def candidate_timings(specs: tuple[str, ...], buckets: tuple[BucketShape, ...], ready: list[float],
                      work: Workload, cl: Cluster, codecs: dict[str, CodecCost]) -> dict[str, list[BucketTiming]]:
    """Step 1: each candidate's timing of each bucket (plain buckets: uncompressed whatever the candidate)."""
    dtype = DTYPES[work.grad_dtype]
    bucket_model = hierarchical_bucket if work.hierarchical else flat_bucket
    out: dict[str, list[BucketTiming]] = {}
    for spec in specs:
        comp, codec = create(spec), codecs.get(spec, CodecCost())
        out[spec] = [bucket_model(comp, b.shapes, b.numel, b.compressed, dtype, cl, codec, r).timing
                     for b, r in zip(buckets, ready)]
    return out


def choose(allowed: tuple[str, ...], timings: dict[str, list[BucketTiming]], compressed: list[bool],
           compute_s: float) -> list[str]:
    """Steps 2–4 of the module docstring: the per-bucket choice."""
    def step(choice: list[str]) -> float:
        return model_step(compute_s, [timings[c][i] for i, c in enumerate(choice)]).step_s

    def plain(c: str, i: int) -> str:
        return c if compressed[i] else "none" if "none" in timings else c

    fixed = {c: step([plain(c, i) for i in range(len(compressed))]) for c in allowed}
    best = min(allowed, key=lambda c: (fixed[c], allowed.index(c)))
    choice = [plain(best, i) for i in range(len(compressed))]
    current = lowest = step(choice)
    for _ in range(2 * len(allowed) + 2):  # passes; each only ever lowers the step
        changed = False
        for i in (i for i in range(len(choice)) if compressed[i]):
            for c in allowed:
                if c == choice[i]:
                    continue
                trial = choice[:i] + [c] + choice[i + 1:]
                t = step(trial)
                better = t < current * (1 - TIE)
                # within TIE of the lowest step seen (not of the current one, so gentler choices cannot
                # drift the step up bucket by bucket)
                as_good_but_gentler = t <= lowest * (1 + TIE) and allowed.index(c) < allowed.index(choice[i])
                if better or as_good_but_gentler:
                    choice, current, changed = trial, t, True
                    lowest = min(lowest, t)
        if not changed:
            break
    return choice


def plan(auto: AutoSpec, work: Workload, cl: Cluster, codecs: dict[str, CodecCost] | None = None) -> AutoPlan:
    """The plan for ``work`` on ``cl`` (module docstring). ``codecs``: encode/decode cost per candidate."""
    buckets, _ = model_buckets(work.model, work.vocab_size, work.bucket_cap_mb, work.min_compress_numel,
                               True, work.grad_dtype)
    return plan_buckets(auto, buckets, work, cl, codecs)


def plan_buckets(auto: AutoSpec, buckets: tuple[BucketShape, ...], work: Workload, cl: Cluster,
                 codecs: dict[str, CodecCost] | None = None) -> AutoPlan:
    """:func:`plan` for given buckets (the run-time policy: the engine's own)."""
    codecs = codecs or {}
    allowed = auto.allowed
    specs = tuple(dict.fromkeys(("none", *allowed)))
    compute, _, ready = ready_times(buckets, work)
    timings = candidate_timings(specs, buckets, ready, work, cl, codecs)
    compressed = [b.compressed for b in buckets]
    choice = choose(allowed, timings, compressed, compute)
    m = model_step(compute, [timings[c][i] for i, c in enumerate(choice)])
    fixed = {c: model_step(compute, [timings[c if compressed[i] else "none"][i] for i in range(len(buckets))]).step_s
             for c in allowed}
    return AutoPlan(choice, m.step_s, m.comm_s, m.link_s, compute, fixed, [b.numel for b in buckets])
