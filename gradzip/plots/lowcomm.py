"""Figures of runs that communicate rarely (``--sync diloco``/``localsgd``) or compress hard:
``loss_vs_bytes`` and ``time_to_target`` (registered in :data:`gradzip.plots.figures.DRAW`).

A *configuration* is a seed group (:func:`gradzip.plots.table.run_groups`: the runs that differ
only by ``seed``), drawn as one point: the seeds' mean, with their spread as error bars by the
rule of the results table (:meth:`gradzip.plots.seeds.Stat.error`: min–max for 2–3 seeds, ± the
standard deviation for 4 or more). A configuration is named by :func:`config_label`: the
``label`` of the grid table it came from (``method = [{label = "diloco-h16-int8", ...}]``), else
its compressor and the other parameters that vary, as the other figures name their series.
Colour is the compressor, as everywhere; the marker is the other varying parameters.

- ``loss_vs_bytes``: final held-out masked-LM loss (``summary.json``'s ``final_eval_mlm_loss``)
  against the bytes one worker sent over the whole run (``bytes_total``), log x. Configurations
  that sent nothing (one worker) cannot sit on a log axis and are named in the caption.
- ``time_to_target``: for each configuration, the modelled time to reach the spec's ``[target]``
  at each of its ``bandwidths`` (:mod:`gradzip.plots.retime`), one marker per bandwidth.
  Configurations whose seeds never reach the target say so in their row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from matplotlib import transforms
from matplotlib.ticker import FuncFormatter, LogLocator

from gradzip.plots import style
from gradzip.plots.captions import clock_of, fixed_caption, fmt_value
from gradzip.plots.grouping import Skip
from gradzip.plots.results import Collection, LossTarget, Run, reference, where_text
from gradzip.plots.retime import bandwidth_columns, retimed_wall, time_to_target_at
from gradzip.plots.seeds import Stat, stat
from gradzip.plots.table import run_groups

LABEL_SIZE = 6.5  # points: the text beside each point


# -- configurations -------------------------------------------------------------------------------

def _table_of(run: Run, tables: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The table of a grid axis of tables that gave ``run`` its parameters (None: none did)."""
    keys = set().union(*(set(t) - {"label"} for t in tables))
    mine = {k for k in keys if k in run.params}
    for t in tables:
        if set(t) - {"label"} == mine and all(where_text(run.params[k]) == where_text(v)
                                              for k, v in t.items() if k != "label"):
            return t
    return None


def config_label(run: Run, col: Collection) -> str:
    """The name of ``run``'s configuration in ``col``: for each grid axis of tables, the table's
    ``label`` (or its ``key=value`` pairs); then every other parameter that varies (seed aside) as
    ``key=value``. Without such an axis: the compressor, then ``· key=value, ...`` of the other
    varying parameters (the series label of :func:`gradzip.plots.grouping.series`)."""
    parts: list[str] = []
    covered: set[str] = set()
    for values in ((col.spec.get("grid") or {}).values()):
        tables = [v for v in values if isinstance(v, dict)] if isinstance(values, list) else []
        t = _table_of(run, tables) if tables else None
        if t is None:
            continue
        covered |= set().union(*(set(x) - {"label"} for x in tables))
        parts.append(str(t["label"]) if "label" in t else
                     ", ".join(f"{k}={fmt_value(v)}" for k, v in t.items()))
    rest = [k for k in col.varying() if k != "seed" and k not in covered]
    if not parts:
        parts, rest = [run.compressor], [k for k in rest if k != "compressor"]
    kv = ", ".join(f"{k}={fmt_value(run.value(k))}" for k in rest)
    return " · ".join(parts) + (f" · {kv}" if kv else "")


@dataclass
class Config:
    """One seed group: its label, compressor (colour), other varying parameters (marker), runs."""

    label: str
    compressor: str
    secondary: str
    runs: list[Run]


def configurations(col: Collection) -> list[Config]:
    """The seed groups of ``col`` in the runs' order (the spec's grid order)."""
    vary = [k for k in col.varying() if k not in ("seed", "compressor")]
    out = []
    for g in run_groups(col):
        sec = ", ".join(f"{k}={fmt_value(g[0].value(k))}" for k in vary)
        out.append(Config(config_label(g[0], col), g[0].compressor, sec, g))
    return out


def _seeds(c: Config) -> int:
    return len({str(r.value("seed")) for r in c.runs})


# -- loss against bytes ---------------------------------------------------------------------------

@dataclass
class BytesPoint:
    """A configuration's point of ``loss_vs_bytes``, over its runs that have both numbers."""

    config: Config
    bytes: Stat  # bytes_total per worker
    loss: Stat  # final_eval_mlm_loss


def bytes_points(col: Collection) -> tuple[list[BytesPoint], list[str]]:
    """The points of ``loss_vs_bytes`` (configurations whose runs have ``bytes_total`` and
    ``final_eval_mlm_loss``; mean > 0 bytes) and the labels of those left out for sending nothing."""
    points, silent = [], []
    for c in configurations(col):
        runs = [r for r in c.runs if r.bytes_total is not None and r.final_eval_mlm_loss is not None]
        if not runs:
            continue
        p = BytesPoint(c, stat([r.bytes_total for r in runs]), stat([r.final_eval_mlm_loss for r in runs]))
        if p.bytes.mean > 0:
            points.append(p)
        else:
            silent.append(c.label)
    return points, silent


def pareto_front(points: list[BytesPoint]) -> list[BytesPoint]:
    """The points no other point beats on both counts (fewer or equal bytes and a lower loss,
    comparing means), by growing bytes."""
    front: list[BytesPoint] = []
    for p in sorted(points, key=lambda p: (p.bytes.mean, p.loss.mean)):
        if not front or p.loss.mean < front[-1].loss.mean:
            front.append(p)
    return front


def bytes_label(x: float, _: Any = None) -> str:
    """``3e9`` -> ``3 GB`` (10^3 steps, as the rest of gradzip counts bytes)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:g} {unit}"
    return f"{x:g} B"


def _log_x(ax, fmt: Any) -> None:
    """Log x axis whose major and minor (2, 5) ticks are written by ``fmt(x, pos)``, so a range
    under a decade still gets readable numbers."""
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(fmt))
    ax.xaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax.xaxis.set_minor_formatter(FuncFormatter(fmt))


def _errors(stats: list[Stat]) -> np.ndarray | None:
    """A 2×N ``xerr``/``yerr`` array from :meth:`Stat.error` (zeros where a stat has no spread)."""
    errs = [s.error() or (0.0, 0.0) for s in stats]
    return None if not any(a or b for a, b in errs) else np.array(errs, dtype=float).T


def _place_labels(fig, ax, items: list[tuple[float, float, str]]) -> None:
    """Write each label beside its point, trying positions around it until one overlaps neither
    an earlier label nor a point (else the first position)."""
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    to_disp = ax.transData.transform
    r = 4.0 * fig.dpi / 72  # a marker's half-size in pixels
    taken = [transforms.Bbox.from_extents(px - r, py - r, px + r, py + r)
             for px, py in (to_disp((x, y)) for x, y, _ in items)]
    frame = ax.get_window_extent(renderer)
    spots = [(6, 3, "left", "bottom"), (6, -3, "left", "top"), (-6, 3, "right", "bottom"),
             (-6, -3, "right", "top"), (0, 7, "center", "bottom"), (0, -7, "center", "top"),
             (10, 0, "left", "center"), (-10, 0, "right", "center")]
    for x, y, text in items:
        chosen = None
        for dx, dy, ha, va in spots:
            t = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", ha=ha, va=va,
                            fontsize=LABEL_SIZE, color="0.15")
            box = t.get_window_extent(renderer)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(box.overlaps(o) for o in taken):
                chosen = box
                break
            t.remove()
        if chosen is None:
            t = ax.annotate(text, (x, y), xytext=spots[0][:2], textcoords="offset points", ha="left", va="bottom",
                            fontsize=LABEL_SIZE, color="0.15")
            chosen = t.get_window_extent(renderer)
        taken.append(chosen)


def fig_loss_vs_bytes(col: Collection, pal: style.Palette, target: LossTarget | None = None):
    points, silent = bytes_points(col)
    if not points and not silent:
        raise Skip("no run has both bytes_total and final_eval_mlm_loss in its summary.json")
    if len(points) < 2:
        raise Skip("fewer than two configurations sent bytes: nothing to compare")
    fig, (ax,) = style.new_figure(width=7.6 if len(points) > 6 else 6.4, height=5.0 if len(points) > 6 else 4.0)
    for p in points:
        _, marker = pal.style(p.config.secondary)
        ax.errorbar([p.bytes.mean], [p.loss.mean], xerr=_errors([p.bytes]), yerr=_errors([p.loss]), marker=marker,
                    markersize=6, color=pal.color(p.config.compressor), linestyle="none", capsize=3, zorder=3)
    front = pareto_front(points)
    if len(front) > 1:
        ax.step([p.bytes.mean for p in front], [p.loss.mean for p in front], where="post", color="0.55",
                linewidth=0.9, linestyle=":", zorder=1)
    runs = [r for p in points for r in p.config.runs]
    ref = reference(runs, "eval_mlm_loss")
    for (value, label), ls in zip(ref, ("--", "-.")):
        ax.axhline(value, color="0.4", linewidth=0.8, linestyle=ls, label=label)
    _log_x(ax, bytes_label)
    ax.set_xlabel("bytes sent per worker over the run (log scale; 1 MB = 10^6 B)")
    ax.set_ylabel("final held-out masked-LM loss (nats)")
    ax.set_title("Loss against bytes sent")
    if ref:  # below the axes: the labelled points may be anywhere inside
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=style.RC["legend.fontsize"],
                  frameon=False)
    _place_labels(fig, ax, [(p.bytes.mean, p.loss.mean, p.config.label) for p in points])
    n = max(_seeds(p.config) for p in points)
    spread = ((" Error bars: " + ("min–max" if n <= 3 else "± the standard deviation") + f" over {n} seeds;"
               " the point is their mean.") if n > 1 else "")
    caption = ("Final held-out masked-LM loss against the bytes one worker sent over the whole run "
               "(summary.json's bytes_total): further left sends less, lower is better. One point per "
               "configuration, labelled; colour is the compressor, the marker the other parameters that vary."
               + spread
               + (" The dotted staircase links the configurations that no other beats on both counts: "
                  + ", ".join(p.config.label for p in front) + "." if len(front) > 1 else "")
               + "".join(f" {how}: {label}." for how, (_, label) in zip(("Dashed", "Dash-dotted"), ref))
               + (f" Not shown (sent no bytes, so no place on a log axis): {', '.join(silent)}." if silent else "")
               + " " + fixed_caption(col))
    return fig, " ".join(caption.split())


# -- modelled time to target at other bandwidths ----------------------------------------------------

@dataclass
class TargetRow:
    """A configuration's row of ``time_to_target``: over its seeds, the steps to the target and the
    modelled seconds at each bandwidth (column name -> Stat over the seeds that reached it)."""

    config: Config
    reached: int  # seeds that reached the target
    seeds: int
    steps: Stat
    times: dict[str, Stat] = field(default_factory=dict)

    @property
    def retimed(self) -> bool:
        """Whether some seed could be re-timed (has a bandwidth, ``comm_s`` and bytes)."""
        return any(s.values for s in self.times.values())


def target_rows(col: Collection, target: LossTarget) -> list[TargetRow]:
    """One :class:`TargetRow` per configuration, in the runs' order."""
    cols = bandwidth_columns(target.bandwidths)
    rows = []
    for c in configurations(col):
        hits = [(r, r.time_to_target(target)) for r in c.runs]
        hit_runs = [r for r, h in hits if h is not None]
        times = {name: stat([time_to_target_at(r, target, bps) for r in hit_runs]) for name, bps in cols}
        rows.append(TargetRow(c, len(hit_runs), len(c.runs), stat([h[0] for _, h in hits if h is not None]), times))
    return rows


def fig_time_to_target(col: Collection, pal: style.Palette, target: LossTarget | None = None):
    if target is None:
        raise Skip("no target loss: give the spec a [target] (or gradzip plot --target LOSS)")
    if not target.bandwidths:
        raise Skip("[target] has no bandwidths to model (e.g. bandwidths = [\"100mbit\", \"1gbit\"], or "
                   "gradzip plot --target-bandwidths 100mbit,1gbit)")
    if not any(retimed_wall(r, 1e9) is not None for r in col.runs):
        raise Skip("no run can be re-timed (none has a bandwidth and per-step comm_s and bytes_sent)")
    cols = bandwidth_columns(target.bandwidths)
    rows = target_rows(col, target)
    fig, (ax,) = style.new_figure(width=7.2, height=1.4 + 0.32 * len(rows))
    dodge = np.linspace(-0.18, 0.18, len(cols)) if len(cols) > 1 else np.zeros(1)
    shown: list[float] = []
    labelled: set[str] = set()
    for j, (name, bps) in enumerate(cols):
        color, marker = style.CYCLE[j % len(style.CYCLE)], style.MARKERS[j % len(style.MARKERS)]
        for full in (True, False):  # hollow markers: means over only some of the seeds
            sel = [(i, r.times[name]) for i, r in enumerate(rows)
                   if r.times[name].values and (r.reached == r.seeds) == full]
            if not sel:
                continue
            ax.errorbar([s.mean for _, s in sel], [i + dodge[j] for i, _ in sel], xerr=_errors([s for _, s in sel]),
                        marker=marker, color=color, markerfacecolor=color if full else "white", markeredgewidth=1.2,
                        linestyle="none", capsize=2.5, markersize=5.5,
                        label=None if name in labelled else style.bandwidth_label(bps))
            labelled.add(name)
            shown += [s.mean for _, s in sel]
    across = transforms.blended_transform_factory(ax.transAxes, ax.transData)
    for i, r in enumerate(rows):
        if r.reached == 0:
            steps = max(run.steps for run in r.config.runs)
            ax.text(0.01, i, f"not reached in {steps} steps" + (f" ({r.seeds} seeds)" if r.seeds > 1 else ""),
                    transform=across, va="center", ha="left", fontsize=7, color="0.35", style="italic")
        elif not r.retimed:
            ax.text(0.01, i, "reached; cannot be re-timed (no bandwidth or comm_s)", transform=across, va="center",
                    ha="left", fontsize=7, color="0.35", style="italic")
    ax.set_yticks(range(len(rows)), [r.config.label + (f" ({r.reached}/{r.seeds} seeds)" if 0 < r.reached < r.seeds
                                                       else "") for r in rows], fontsize=7.5)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.grid(axis="y", visible=False)
    if shown and max(shown) > 3 * max(min(shown), 1e-12):
        _log_x(ax, lambda x, _=None: f"{x:g}")
    elif shown:
        ax.set_xlim(left=0)
    what = "eval loss" if target.metric == "eval_loss" else f"training loss (EMA {target.smoothing:g})"
    ax.set_xlabel("modelled time to target (s" + (", log scale)" if ax.get_xscale() == "log" else ")"))
    ax.set_title(f"Time to {what} ≤ {target.loss:g} by link bandwidth")
    style.legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="link bandwidth")
    never = [r.config.label for r in rows if r.reached == 0]
    partial = [f"{r.config.label} ({r.reached}/{r.seeds})" for r in rows if 0 < r.reached < r.seeds]
    n = max(r.seeds for r in rows)
    caption = (f"Modelled time until the {what} first reaches {target.loss:g}, at each link bandwidth, one row per "
               "configuration. Each run is re-timed step by step from its own clock "
               f"({clock_of(col.runs)}) as if its link had that bandwidth: a step's exposed communication changes "
               "by the link time of the bytes it sent at that bandwidth instead of the run's own (never below 0; the "
               "overlap with backward and the latency stay as they were), compute, compression and optimizer time "
               "stay; the target is reached at the same step (gradzip.plots.retime)."
               + ((" Markers: mean over the seeds; error bars: " + ("min–max" if n <= 3 else "± the standard deviation")
                   + ".") if n > 1 else "")
               + (f" Never reached: {', '.join(never)}." if never else "")
               + (f" Reached by some seeds only (hollow markers: their mean): {', '.join(partial)}." if partial else "")
               + " " + fixed_caption(col, {"bandwidth"}))
    return fig, " ".join(caption.split())
