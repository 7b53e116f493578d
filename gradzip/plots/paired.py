"""Paired differences over seeds: a compressor against ``none``, seed by seed.

Runs of the same seed share their initialisation and data order across compressors (the seed
drives both), so the difference of two configurations is best measured *per seed*: ``a - b`` of
the runs with that seed. The contract:

- :func:`paired_diffs` matches the runs of ``a`` and ``b`` by ``run.value("seed")`` and keeps a
  seed only when both sides have it and a finite value of the key (``final_eval_loss`` by default);
  a run without a whole-number seed cannot be paired and is left out; a seed twice on one side
  counts once (its first run).
- :class:`Paired` holds those differences in seed order. Their mean has the two-sided 95% Student
  t interval ``mean ± t(0.975, n-1) · s / √n`` (``s`` the sample standard deviation), from
  ``n >= 2`` pairs; with fewer there is no interval and the verdict is ``"—"``.
- The verdict reads the interval for a loss (lower is better, so ``a - b > 0`` is worse):
  ``"worse"`` when it lies above 0, ``"better"`` when below 0, else ``"within noise"``.
- :meth:`Paired.seeds_to_decide` says, for a result within noise, how many seeds an interval with
  the same mean and standard deviation would need to leave 0 out: a planning figure, not a promise
  (the next seeds will move both).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from scipy import stats

from gradzip.plots.results import Run

CONFIDENCE = 0.95
MAX_SEEDS = 1000  # seeds_to_decide looks no further


def t_quantile(n: int) -> float:
    """The two-sided 95% t quantile for a mean of ``n`` values (``n - 1`` degrees of freedom)."""
    return float(stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1))


@dataclass
class Paired:
    """Differences ``a - b`` of the same seed, as ``(seed, difference)`` in seed order."""

    diffs: list[tuple[int, float]]

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def values(self) -> list[float]:
        return [d for _, d in self.diffs]

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.diffs else None

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.values) if self.n >= 2 else None

    @property
    def half_width(self) -> float | None:
        """Half the 95% interval: ``t(0.975, n-1) · s / √n`` (None for fewer than 2 pairs)."""
        if self.std is None:
            return None
        return t_quantile(self.n) * self.std / math.sqrt(self.n)

    @property
    def lo(self) -> float | None:
        h = self.half_width
        return None if h is None or self.mean is None else self.mean - h

    @property
    def hi(self) -> float | None:
        h = self.half_width
        return None if h is None or self.mean is None else self.mean + h

    @property
    def verdict(self) -> str:
        lo, hi = self.lo, self.hi
        if lo is None or hi is None:
            return "—"
        if lo > 0:
            return "worse"
        if hi < 0:
            return "better"
        return "within noise"

    def seeds_to_decide(self) -> int | None:
        """For a result within noise, the fewest seeds (at least ``n``, at most 1000) at which
        ``t(0.975, m-1) · s / √m < |mean|`` with today's mean and standard deviation; None for a
        decided result, a zero mean, fewer than 2 pairs, or more than 1000 seeds needed."""
        if self.verdict != "within noise" or not self.mean or self.std is None:
            return None
        m = np.arange(self.n, MAX_SEEDS + 1)
        half = stats.t.ppf(0.5 + CONFIDENCE / 2, m - 1) * self.std / np.sqrt(m)
        hit = np.nonzero(half < abs(self.mean))[0]
        return int(m[hit[0]]) if hit.size else None


def _value(run: Run, key: str) -> float | None:
    # The table's own accessor where the Run has one (final_eval_loss falls back to metrics.jsonl).
    v = getattr(run, key) if isinstance(getattr(Run, key, None), property) else (run.summary or {}).get(key)
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _by_seed(runs: Iterable[Run], key: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in runs:
        try:
            seed = int(r.value("seed"))
        except (TypeError, ValueError):
            continue  # no seed, no pairing
        v = _value(r, key)
        if v is not None:
            out.setdefault(seed, v)
    return out


def paired_diffs(a_runs: Iterable[Run], b_runs: Iterable[Run], key: str = "final_eval_loss") -> Paired:
    """``a - b`` of ``key`` for every seed both sides ran (see the module docstring)."""
    a, b = _by_seed(a_runs, key), _by_seed(b_runs, key)
    return Paired([(s, a[s] - b[s]) for s in sorted(a.keys() & b.keys())])


def signed(v: float) -> str:
    """``+0.0123`` / ``-0.0040``, never ``-0.0000``."""
    return f"{v if abs(v) >= 5e-5 else 0.0:+.4f}"


def per_seed_text(p: Paired) -> str:
    return ", ".join(signed(d) for _, d in p.diffs) if p.diffs else "—"


def interval_text(p: Paired) -> str:
    if p.mean is None or p.lo is None or p.hi is None:
        return "—"
    return f"{signed(p.mean)} [{signed(p.lo)}, {signed(p.hi)}]"


def verdict_text(p: Paired) -> str:
    n = p.seeds_to_decide()
    return p.verdict + (f" (≈{n} seeds to decide)" if n is not None else "")


NOTE = ("Paired columns: runs of the same seed share initialisation and data order across compressors, so "
        "each seed's final eval loss minus that of the `none` run of the same seed (otherwise equal parameters) "
        "is one paired difference. Δ per seed lists them in seed order; Δ mean [95% CI] is their mean with the "
        "two-sided 95% Student t interval, mean ± t(0.975, n−1)·s/√n (s: the sample standard deviation of the "
        "n differences). verdict: worse when the interval lies above 0, better when it lies below 0 (lower "
        "loss is better), within noise when it holds 0, with (≈N seeds to decide): the seeds at which an "
        "interval with the same mean and standard deviation would leave 0 out; — with fewer than 2 paired "
        "seeds.")
