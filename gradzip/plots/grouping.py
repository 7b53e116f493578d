"""How a figure groups its runs: *series* (one line or bar each: runs that differ only by seed)
and *panels* (a grid of subplots when one would hold too many series), the mean/min/max over a
group, and :class:`Skip`, which a figure raises when the data cannot make it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradzip.plots import style
from gradzip.plots.captions import fmt_value
from gradzip.plots.results import Collection, Run


class Skip(Exception):
    """The data cannot make this figure; the message says why."""


@dataclass
class Series:
    label: str
    compressor: str
    secondary: str  # the other varying parameters' text ('' if none): picks line style
    runs: list[Run]

    @property
    def clock(self) -> str:
        clocks = {r.clock for r in self.runs}
        return clocks.pop() if len(clocks) == 1 else "mixed"


def series(col: Collection, exclude: set[str] = frozenset()) -> list[Series]:
    """Group runs into series: same compressor and same varying parameters except ``exclude`` and seed."""
    vary = [k for k in col.varying() if k not in exclude and k not in ("compressor", "seed")]
    out: dict[tuple, Series] = {}
    for r in col.runs:
        sec = ", ".join(f"{k}={fmt_value(r.value(k))}" for k in vary)
        key = (r.compressor, sec)
        if key not in out:
            label = r.compressor + (f" · {sec}" if sec else "")
            out[key] = Series(label, r.compressor, sec, [])
        out[key].runs.append(r)
    return list(out.values())


def _values(runs: list[Run], key: str) -> list[Any]:
    """Distinct values of ``key`` in the runs' order (which is the spec's grid order)."""
    out: list[Any] = []
    for r in runs:
        v = r.value(key)
        if all(str(v) != str(o) for o in out):
            out.append(v)
    return out


@dataclass
class Panels:
    row_key: str | None
    col_key: str | None
    row_values: list[Any]
    col_values: list[Any]
    cells: dict[tuple[str, str], Collection]

    def text(self) -> str:
        keys = [k for k in (self.col_key, self.row_key) if k]
        return f" One panel per {' and '.join(keys)}." if keys else ""


def panels(col: Collection, exclude: set[str], max_series: int = 8) -> Panels:
    """Split runs into a grid of panels when one panel would hold more than ``max_series`` series.

    Columns take the first varying parameter (besides compressor, seed and ``exclude``), rows the
    second, if needed; within a panel, series are labelled by what still varies there.
    """
    keys = [k for k in col.varying() if k not in exclude and k not in ("compressor", "seed")]
    n = len(series(col, exclude))
    if n <= max_series or not keys:
        return Panels(None, None, [None], [None], {("None", "None"): col})
    ckey, cvals = keys[0], _values(col.runs, keys[0])
    rkey, rvals = None, [None]
    if len(keys) > 1 and n / len(cvals) > max_series:
        rkey, rvals = keys[1], _values(col.runs, keys[1])
    cells = {}
    for rv in rvals:
        for cv in cvals:
            runs = [r for r in col.runs if (rkey is None or str(r.value(rkey)) == str(rv))
                    and str(r.value(ckey)) == str(cv)]
            if runs:
                cells[(str(rv), str(cv))] = Collection(col.root, runs, col.sweep)
    return Panels(rkey, ckey, rvals, cvals, cells)


def facetted(col: Collection, exclude: set[str], draw: Callable[[Any, Collection], None], xlabel: str,
             ylabel: str, max_series: int = 8, sharey: bool = True, single_width: float | None = None):
    """Draw ``draw(ax, sub_collection)`` on each panel; label axes; one legend. Returns (fig, Panels)."""
    pn = panels(col, exclude, max_series)
    nr, nc = len(pn.row_values), len(pn.col_values)
    width = single_width if nr * nc == 1 else None
    fig, axes = style.new_figure(ncols=nc, nrows=nr, sharex=True, sharey=sharey, width=width)
    for i, rv in enumerate(pn.row_values):
        for j, cv in enumerate(pn.col_values):
            ax = axes[i * nc + j]
            sub = pn.cells.get((str(rv), str(cv)))
            if sub is None:
                ax.set_visible(False)
                continue
            draw(ax, sub)
            title = ", ".join(f"{k}={fmt_value(v)}" for k, v in ((pn.col_key, cv), (pn.row_key, rv)) if k)
            if title:
                ax.set_title(title)
    if nr * nc == 1:
        axes[0].set_xlabel(xlabel)
        axes[0].set_ylabel(ylabel)
        legend(axes[0], len(axes[0].get_legend_handles_labels()[0]))
    else:
        fig.supxlabel(xlabel, fontsize=style.RC["axes.labelsize"])
        fig.supylabel(ylabel, fontsize=style.RC["axes.labelsize"])
        seen: dict[str, Any] = {}
        for ax in axes:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                seen.setdefault(lab, h)
        if seen:
            fig.legend(list(seen.values()), list(seen), loc="center left", bbox_to_anchor=(1.0, 0.5),
                       fontsize=style.RC["legend.fontsize"], frameon=False)
    return fig, pn


def legend(ax, n: int) -> None:
    """The legend inside the axes, or beside them when it has more than six entries."""
    if n > 6:
        style.legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        style.legend(ax)


def mean_curve(runs: list[Run], xs_of: Callable[[Run], list[float]],
               ys_of: Callable[[Run], list[float]]) -> tuple[np.ndarray, ...]:
    """Mean, min and max over runs, truncated to the shortest run (seeds have equal step counts)."""
    n = min(len(ys_of(r)) for r in runs)
    xs = np.mean([xs_of(r)[:n] for r in runs], axis=0)
    ys = np.array([ys_of(r)[:n] for r in runs])
    return xs, ys.mean(axis=0), ys.min(axis=0), ys.max(axis=0)


def smoothing_half_window(steps: int) -> int:
    """Half-width of the loss curves' moving average: about 2% of the run on each side (200 steps: 9 points)."""
    return max(0, round(steps / 50))


def by(runs: list[Run], key: Callable[[Run], float | None], value: Callable[[Run], float | None]):
    """{x: (mean, min, max)} of ``value`` grouped by ``key`` (None values dropped)."""
    acc: dict[float, list[float]] = {}
    for r in runs:
        k, v = key(r), value(r)
        if k is not None and v is not None:
            acc.setdefault(k, []).append(v)
    return {k: (float(np.mean(v)), min(v), max(v)) for k, v in sorted(acc.items())}
