"""Aggregation over seeds: runs that differ only by ``seed`` form one *group*.

The results table shows a group's mean with its spread, written as

- ``7.123`` for one seed (or when every seed gives the same number);
- ``7.123 (7.120–7.127)``, the mean and the min–max range, for 2 or 3 seeds;
- ``7.123 ± 0.004``, the mean and the sample standard deviation, for 4 seeds or more.

The point figures of :mod:`gradzip.plots.lowcomm` draw the same spread as error bars
(:meth:`Stat.error`); curves elsewhere show the min–max band.

A difference between two groups (Δ vs none) *exceeds the seed spread* when its absolute value is
larger than the wider of the two groups' min–max ranges. The rule is deliberately simple and
conservative: with 3 seeds it asks the difference to be larger than everything the seed alone did
to either configuration. With one seed on both sides there is no spread to compare against, and
the table says so.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any


@dataclass
class Stat:
    """Mean, spread and count of one number over a group's seeds (None values left out)."""

    values: list[float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.values) if self.n >= 2 else None

    @property
    def lo(self) -> float | None:
        return min(self.values) if self.values else None

    @property
    def hi(self) -> float | None:
        return max(self.values) if self.values else None

    @property
    def range(self) -> float | None:
        return self.hi - self.lo if self.n >= 2 else None

    def text(self, fmt: Any) -> str:
        """The table cell: see the module docstring; ``fmt`` formats one number."""
        if not self.values:
            return "—"
        if self.n == 1 or self.lo == self.hi:  # one seed, or every seed alike (bytes per step)
            return fmt(self.values[0])
        if self.n <= 3:
            return f"{fmt(self.mean)} ({fmt(self.lo)}–{fmt(self.hi)})"
        return f"{fmt(self.mean)} ± {fmt(self.std)}"

    def error(self) -> tuple[float, float] | None:
        """Error-bar lengths (below, above) the mean, by the rule of :meth:`text`: the min–max range
        for 2–3 values, ± the standard deviation for 4 or more; None for one value or all alike."""
        if self.n < 2 or self.lo == self.hi:
            return None
        if self.n <= 3:
            return self.mean - self.lo, self.hi - self.mean
        return self.std, self.std


def stat(values: list[Any]) -> Stat:
    return Stat([float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))])


def exceeds_spread(a: Stat, b: Stat) -> bool | None:
    """Whether ``a.mean - b.mean`` is larger than the wider seed range of the two (None: no spread
    known, because neither group has two seeds, or a mean is missing)."""
    spreads = [s.range for s in (a, b) if s.range is not None]
    if a.mean is None or b.mean is None or not spreads:
        return None
    return abs(a.mean - b.mean) > max(spreads)


def spread_of(a: Stat, b: Stat) -> float | None:
    """The wider seed range of the two groups (what :func:`exceeds_spread` compares against)."""
    spreads = [s.range for s in (a, b) if s.range is not None]
    return max(spreads) if spreads else None
