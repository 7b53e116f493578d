"""Goodput of an outer sync (DiLoCo, LocalSGD) whose replicas fail and heal: ``gradzip simulate
--mtbf`` (or ``--failures-per-minute``), ``--recovery``, ``--min-replicas``.

Failures are counted per replica, as the Decoupled DiLoCo paper (arXiv 2604.21428) counts them
per chip: a replica fails after an exponentially distributed up-time of mean MTBF, so n
replicas fail together at n / MTBF (a cluster-wide rate of F failures per minute is an MTBF of
60 · n / F seconds per replica). Goodput is committed tokens per second against the fault-free
run. The model works in rounds: one round is the H inner steps and the sync that ends them.

1. Round length T = H · compute_s + sync_exposed_s (the cost model's period,
   :mod:`gradzip.cluster.simulate`), the same with or without failures: a round that cannot
   commit is retried and costs T again; a smaller quorum's sync is charged as the full one.
2. A replica live at the start of a round fails in it with probability q = 1 − exp(−T / MTBF).
   It loses its work of the round (everything since the last commit) and is absent for
   A = recovery + heal: a fixed restart time (``--recovery``) plus copying the fp32 parameters,
   and the outer optimizer's momentum where it has one (4 or 8 bytes per parameter), from a live
   peer over one link (the inter-node link; inside the node when there is one node):
   heal = α + bytes · 8 / (B · link_efficiency). The heal is charged to the failed replica only.
3. It rejoins at the first round that starts after it is back (the quorum forms at round starts).
   Failing at time u into the round (u has the density λe^(−λu) / (1 − e^(−λT)) on [0, T],
   λ = 1 / MTBF), it misses D = ⌈(u + A) / T⌉ − 1 whole rounds after the one it failed in.
   With k = ⌊A / T⌋ and t = (k + 1)T − A ∈ (0, T]:
   E[D] = k + P(u > t) = k + e^(−λt) (1 − e^(−λ(T − t))) / (1 − e^(−λT))   (λ → 0: k + 1 − t/T).
4. Each replica alternates a run of live rounds (geometric: 1/q on average, the last one failed)
   and D absent rounds, independently of the others. In the long run it is live at a round start
   with probability π = 1 / (1 + q · E[D]) and finishes the round (contributes) with probability
   p = π (1 − q); the replicas being independent, the number that finish a round is
   S ~ Binomial(n, p).
5. A round commits when S ≥ m (``--min-replicas``):
   P(commit) = Σ_{k=m..n} C(n, k) p^k (1 − p)^(n−k);
   participants = E[S | S ≥ m]; participation = participants / n (the mean fraction of the
   replicas in a committed sync);
   goodput = E[S · 1{S ≥ m}] / n = Σ_{k=m..n} (k / n) C(n, k) p^k (1 − p)^(n−k)
   (a fault-free round commits n · H steps of tokens in the same T).

Not modelled: failures during recovery, a failed sync's own time (T is charged whole),
stragglers and timeouts, correlated failures (a node taking down its GPUs together), what a
smaller quorum does to the loss per token, and the stall a failure causes the live replicas: the
sync after it waits for the failed one until its heartbeat expires, the sync in which it rejoins
waits for its heal, and the process group is rebuilt twice (measured on torchft with 4 replica
groups: 3 to 4.6 s per failure, docs/reproductions/repro-chaos/results.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from gradzip.errors import GradzipError

if TYPE_CHECKING:  # types only: the model needs the cost model's numbers, not its code
    from gradzip.cluster.network import Cluster
    from gradzip.cluster.simulate import Prediction
    from gradzip.plan.sync import SyncSpec


@dataclass(frozen=True)
class Faults:
    """The failure process: mean up-time per replica (``math.inf``: none), the fixed restart time
    of a failed replica, and the quorum size below which a round cannot commit."""

    mtbf_s: float
    recovery_s: float = 0.0
    min_replicas: int = 1

    def __post_init__(self) -> None:
        if not self.mtbf_s > 0 or math.isnan(self.mtbf_s):
            raise GradzipError(f"--mtbf must be positive (e.g. 60s, 30min), got {self.mtbf_s:g} s")
        if not (self.recovery_s >= 0 and math.isfinite(self.recovery_s)):
            raise GradzipError(f"--recovery must be a finite time >= 0 (e.g. 20s), got {self.recovery_s:g} s")
        if self.min_replicas < 1:
            raise GradzipError(f"--min-replicas must be >= 1, got {self.min_replicas}")


@dataclass(frozen=True)
class Goodput:
    """The model's prediction for one outer sync (fields: the module docstring's symbols)."""

    replicas: int               # n
    min_replicas: int           # m
    mtbf_s: float               # per replica
    round_s: float              # T
    recovery_s: float           # the fixed restart time
    heal_s: float               # the heal's transfer from a live peer
    absent_s: float             # A = recovery + heal
    fail_probability: float     # q: a live replica fails in a round
    rounds_absent: float        # E[D]: whole rounds missed after the failed one
    live_probability: float     # π: live at a round's start
    finish_probability: float   # p = π (1 − q): finishes the round
    commit_probability: float   # P(S ≥ m)
    participants: float         # E[S | S ≥ m]
    participation: float        # participants / n
    goodput: float              # E[S · 1{S ≥ m}] / n


def mtbf_from_rate(failures_per_minute: float, replicas: int) -> float:
    """MTBF per replica of a cluster of ``replicas`` failing ``failures_per_minute`` times a
    minute in all (0: ``math.inf``)."""
    if not (failures_per_minute >= 0 and math.isfinite(failures_per_minute)):
        raise GradzipError(f"--failures-per-minute must be a finite number >= 0, got {failures_per_minute:g}")
    return math.inf if failures_per_minute == 0 else 60.0 * replicas / failures_per_minute


def fail_probability(round_s: float, mtbf_s: float) -> float:
    """q = 1 − exp(−T / MTBF): a replica live at a round's start fails before its end."""
    return -math.expm1(-round_s / mtbf_s)


def rounds_absent(round_s: float, absent_s: float, mtbf_s: float) -> float:
    """E[D] = E[⌈(u + A) / T⌉] − 1 for u, the failure time within the round, exponential of mean
    MTBF truncated to [0, T] (3. of the module docstring)."""
    k = math.floor(absent_s / round_s)
    t = (k + 1) * round_s - absent_s  # in (0, T]: how far into round k + 1 a failure at 0 would be back
    if math.isinf(mtbf_s):
        return k + 1.0 - t / round_s  # u uniform on [0, T]
    lam = 1.0 / mtbf_s
    tail = math.exp(-lam * t) * -math.expm1(-lam * (round_s - t)) / -math.expm1(-lam * round_s)
    return k + tail


def binomial_pmf(n: int, p: float) -> list[float]:
    """P(S = k) for k = 0..n, S ~ Binomial(n, p); in logarithms, so that thousands of replicas
    neither overflow C(n, k) nor underflow p^k."""
    if p <= 0.0 or p >= 1.0:
        return [1.0 if k == (n if p >= 1.0 else 0) else 0.0 for k in range(n + 1)]
    lp, lq, ln = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    return [math.exp(ln - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp + (n - k) * lq) for k in range(n + 1)]


def goodput(replicas: int, round_s: float, faults: Faults, heal_s: float = 0.0) -> Goodput:
    """The model of the module docstring for ``replicas`` replicas syncing every ``round_s``
    seconds, a failed one absent for ``faults.recovery_s + heal_s``."""
    n, m = replicas, faults.min_replicas
    if m > n:
        raise GradzipError(f"--min-replicas {m} is more than the {n} replicas (nodes x gpus-per-node); "
                           f"give at most {n}")
    if not (round_s > 0 and math.isfinite(round_s)) or not heal_s >= 0:
        raise GradzipError(f"a round must take a positive time, got {round_s:g} s (heal {heal_s:g} s)")
    absent = faults.recovery_s + heal_s
    q = fail_probability(round_s, faults.mtbf_s)
    d = rounds_absent(round_s, absent, faults.mtbf_s)
    live = 1.0 / (1.0 + q * d)
    p = live * (1.0 - q)
    pmf = binomial_pmf(n, p)
    commit = sum(pmf[m:])
    tokens = sum(k * pmf[k] for k in range(m, n + 1))  # E[S · 1{S ≥ m}]
    participants = tokens / commit if commit > 0 else 0.0
    return Goodput(replicas=n, min_replicas=m, mtbf_s=faults.mtbf_s, round_s=round_s, recovery_s=faults.recovery_s,
                   heal_s=heal_s, absent_s=absent, fail_probability=q, rounds_absent=d, live_probability=live,
                   finish_probability=p, commit_probability=commit, participants=participants,
                   participation=participants / n, goodput=tokens / n)


def heal_bytes(params: int, outer_momentum: bool) -> int:
    """Bytes a rejoining replica copies from a live peer: the fp32 parameters, and the outer
    optimizer's fp32 momentum when the sync has one."""
    return params * 4 * (2 if outer_momentum else 1)


def heal_seconds(nbytes: float, bandwidth_bps: float, latency_s: float = 0.0) -> float:
    """α + bytes · 8 / B: one transfer of ``nbytes`` over a link of ``bandwidth_bps`` (already
    scaled by the link efficiency)."""
    return latency_s + nbytes * 8.0 / bandwidth_bps


def predict_goodput(p: Prediction, sync: SyncSpec, cl: Cluster, faults: Faults) -> Goodput | None:
    """The model for one row of ``gradzip simulate``: every worker a replica, T = H · compute_s +
    sync_exposed_s of the cost model's prediction ``p``, the heal over the inter-node link (inside
    the node on one node). None for ``step``, which has no rounds."""
    if not sync.outer:
        return None
    link = cl.inter() if cl.nodes > 1 else cl.intra()
    heal = heal_seconds(heal_bytes(p.params, sync.momentum > 0), link.bandwidth_bps, link.latency_s)
    return goodput(cl.workers, sync.every * p.compute_s + p.sync_exposed_s, faults, heal)


def json_fields(g: Goodput | None, tokens_per_s: float) -> dict[str, float | int | None]:
    """The fields ``gradzip simulate --json`` adds to a row: every field of :class:`Goodput` and
    ``committed_tokens_per_s`` (all None for a row without rounds; an infinite MTBF is None)."""
    if g is None:
        return dict.fromkeys([f.name for f in fields(Goodput)] + ["committed_tokens_per_s"])
    out: dict[str, float | int | None] = dict(asdict(g), committed_tokens_per_s=tokens_per_s * g.goodput)
    out["mtbf_s"] = None if math.isinf(g.mtbf_s) else g.mtbf_s
    return out
