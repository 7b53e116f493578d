"""What a step costs: ``throughput_bandwidth`` (with the bandwidth where compression stops
paying), ``bytes_per_step``, ``step_time`` (where a step's time goes) and ``scaling`` (efficiency
against workers). Registered in :data:`gradzip.plots.figures.DRAW`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from matplotlib.ticker import FuncFormatter

from gradzip.plots import style
from gradzip.plots.captions import clock_caption, clock_of, fixed_caption, fmt_value, seed_note
from gradzip.plots.grouping import Skip, by, facetted, series
from gradzip.plots.results import NOT_BYTES_KEYS, Collection, LossTarget


def crossover(bws: list[float], thr_c: list[float], thr_none: list[float]) -> float | None:
    """Bandwidth where a compressor's throughput falls to the baseline's (log-log interpolation).

    Returns the first crossing from "compression pays" (ratio > 1) to "does not" (ratio ≤ 1) with
    growing bandwidth, or None if there is none in the measured range.
    """
    ratios = [math.log(c / b) for c, b in zip(thr_c, thr_none)]
    for i in range(len(bws) - 1):
        if ratios[i] > 0 >= ratios[i + 1]:
            a, b = math.log(bws[i]), math.log(bws[i + 1])
            t = ratios[i] / (ratios[i] - ratios[i + 1])
            return math.exp(a + t * (b - a))
    return None


def fig_throughput_bandwidth(col: Collection, pal: style.Palette, target: LossTarget | None = None):
    if len({r.bandwidth_bps for r in col.runs if r.bandwidth_bps}) < 2:
        raise Skip("the runs have fewer than two bandwidths")
    notes: list[str] = []

    def draw(ax, sub: Collection) -> None:
        curves: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
        for s in series(sub, exclude={"bandwidth"}):
            pts = by(s.runs, lambda r: r.bandwidth_bps, lambda r: r.samples_per_s)
            if not pts:
                continue
            xs = list(pts)
            ys = [pts[x][0] for x in xs]
            curves[(s.compressor, s.secondary)] = (xs, ys)
            ls, marker = pal.style(s.secondary)
            color = pal.color(s.compressor)
            ax.plot(xs, ys, color=color, linestyle=ls, marker=marker, label=f"{s.label} ({s.clock})")
            if len(s.runs) > len(pts):
                ax.fill_between(xs, [pts[x][1] for x in xs], [pts[x][2] for x in xs], color=color, alpha=0.15,
                                linewidth=0)
        where = ", ".join(f"{k}={fmt_value(v)}" for k, v in _panel_values(sub, col).items())
        for (comp, sec), (xs, ys) in curves.items():
            base = next((v for (c, s2), v in curves.items() if s2 == sec and c.split(":")[0] == "none"), None)
            if base is None or comp.split(":")[0] == "none":
                continue
            common = [x for x in xs if x in base[0]]
            if len(common) < 2:
                continue
            yc = [ys[xs.index(x)] for x in common]
            yb = [base[1][base[0].index(x)] for x in common]
            cross = crossover(common, yc, yb)
            name = comp + "".join(f" ({t})" for t in (sec, where) if t)
            if cross is not None:
                ax.axvline(cross, color=pal.color(comp), linewidth=0.8, linestyle=":", alpha=0.8)
                notes.append(f"{name} stops paying above ≈{style.bandwidth_label(cross)}")
            elif all(c > b for c, b in zip(yc, yb)):
                notes.append(f"{name} pays at every bandwidth shown")
            elif all(c <= b for c, b in zip(yc, yb)):
                notes.append(f"{name} never beats `none` here")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: style.bandwidth_label(x)))
        ys_all = [y for _, ys in curves.values() for y in ys]
        if ys_all and max(ys_all) > 3 * min(ys_all):  # log only when the data spans a wide range
            style.log_y(ax)

    clock = clock_of(col.runs)
    fig, pn = facetted(col, {"bandwidth"}, draw, "link bandwidth (log scale)",
                        f"throughput (samples/s, {clock})", sharey=False,
                        single_width=7.2 if len(series(col, {"bandwidth"})) > 6 else None)
    if len(fig.axes) == 1:
        fig.axes[0].set_title("Throughput against bandwidth")
    groups = series(col, exclude={"bandwidth"})
    caption = ("Global training throughput against link bandwidth for each compressor; dotted vertical lines mark "
               "where a compressor's throughput falls to that of uncompressed fp32 (`none`), i.e. where compression "
               "stops paying. " + ("; ".join(notes) + ". " if notes else "")
               + "Compute and compression times are measured in every run, so where communication is negligible "
               "(fast links) the curves differ only by compression overhead and measurement noise. "
               + seed_note(groups) + pn.text() + " "
               + clock_caption(col.runs) + " " + fixed_caption(col, {"bandwidth"}))
    return fig, " ".join(caption.split())


def _panel_values(sub: Collection, col: Collection) -> dict[str, Any]:
    """Parameters that vary in ``col`` but are constant in the panel ``sub`` (the panel's title)."""
    if sub is col:
        return {}
    inner = set(sub.varying())
    return {k: sub.runs[0].value(k) for k in col.varying() if k not in inner and k not in ("compressor", "seed")
            and k != "bandwidth"}


def fig_bytes_per_step(col: Collection, pal: style.Palette, target: LossTarget | None = None):
    groups = [s for s in series(col, exclude=NOT_BYTES_KEYS) if any(r.bytes_per_step for r in s.runs)]
    if len(groups) < 2:
        raise Skip("only one compressor/configuration: nothing to compare")
    fig, (ax,) = style.new_figure(width=max(5.0, 0.6 * len(groups) + 2))
    vals = [float(np.mean([r.bytes_per_step for r in s.runs if r.bytes_per_step])) / 1e6 for s in groups]
    xs = np.arange(len(groups))
    ax.bar(xs, vals, color=[pal.color(s.compressor) for s in groups], width=0.65)
    for x, v in zip(xs, vals):
        ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                    textcoords="offset points")
    style.log_y(ax)
    ax.set_xticks(xs, [s.label for s in groups], rotation=35, ha="right")
    ax.set_ylabel("sent per rank per step (MB, log scale)")
    ax.set_xlabel("compressor")
    ax.set_title("Bytes on the wire per optimizer step")
    ax.grid(axis="x", visible=False)
    caption = ("Megabytes (10^6 bytes) each rank sends per optimizer step, by compressor, counted with the "
               "collective algorithms' formulas (ring allreduce, allgather). Log scale. "
               + fixed_caption(col, NOT_BYTES_KEYS))
    return fig, caption.strip()


PHASE_LABELS = (("compute", "compute"), ("compress", "compression"), ("comm", "exposed communication"),
                ("opt", "optimizer"))


def fig_step_time(col: Collection, pal: style.Palette, target: LossTarget | None = None):
    runs = [r for r in col.runs if r.train_rows]
    if not runs:
        raise Skip("no metrics.jsonl rows")
    col = Collection(col.root, runs, col.sweep)
    peak = max(sum(r.phase_means().values()) for r in runs) or 1.0
    scale, unit = (1e3, "ms") if peak < 2 else (1.0, "s")

    def draw(ax, sub: Collection) -> None:
        groups = series(sub)
        xs = np.arange(len(groups))
        bottom = np.zeros(len(groups))
        for phase, label in PHASE_LABELS:
            h = np.array([np.mean([r.phase_means()[phase] for r in s.runs]) * scale for s in groups])
            ax.bar(xs, h, bottom=bottom, color=style.PHASES[phase], width=0.65, label=label)
            bottom += h
        ax.set_xticks(xs, [s.label + (" *" if any(r.contended for r in s.runs) else "") for s in groups],
                      rotation=35, ha="right", fontsize=7.5)
        for x, s, top in zip(xs, groups, bottom):  # contended runs: hatched outline over the whole bar
            if any(r.contended for r in s.runs):
                ax.bar(x, top, width=0.65, fill=False, hatch="//", edgecolor="0.35", linewidth=0)
        ax.grid(axis="x", visible=False)

    n = len(series(col))
    fig, pn = facetted(col, set(), draw, "compressor", f"time per step ({unit}, {clock_of(runs)})",
                        max_series=12, sharey=True, single_width=max(5.0, 0.6 * n + 2))
    if len(fig.axes) == 1:
        fig.axes[0].set_title("Where a step's time goes")
    caption = ("Mean time of an optimizer step (first step excluded) split into computation (forward and backward), "
               "compression (compress + decompress), communication not hidden behind the backward pass "
               "(exposed) and the optimizer step." + pn.text() + " " + clock_caption(runs) + " " + fixed_caption(col))
    return fig, " ".join(caption.split())


def fig_scaling(col: Collection, pal: style.Palette, target: LossTarget | None = None):
    """Efficiency(N) = throughput(N) / (N/N0 · throughput_ref(N0)). The reference is the uncompressed
    (``none``) run at the smallest worker count N0 (usually 1, where nothing is communicated) with
    otherwise equal settings, so a compressor's own overhead counts against it (as in Lin, Li and
    Pekhimenko 2020); without such a run, the series' own N0 run."""
    ns = sorted({r.workers for r in col.runs})
    if len(ns) < 2:
        raise Skip("the runs have only one worker count")
    refs: set[str] = set()

    def draw(ax, sub: Collection) -> None:
        groups = series(sub, exclude={"workers"})
        base = {s.secondary: by(s.runs, lambda r: r.workers, lambda r: r.samples_per_s)
                for s in groups if s.compressor.split(":")[0].strip() == "none"}
        for s in groups:
            pts = by(s.runs, lambda r: r.workers, lambda r: r.samples_per_s)
            if len(pts) < 2:
                continue
            n0 = min(pts)
            ref_pts = base.get(s.secondary) or {}
            if n0 in ref_pts:
                ref, how = ref_pts[n0][0], f"`none` at N={n0}"
            else:
                ref, how = pts[n0][0], f"the same compressor at N={n0}"
            refs.add(how)
            xs = list(pts)
            eff = [100.0 * pts[n][0] / (n / n0 * ref) for n in xs]
            ls, marker = pal.style(s.secondary)
            ax.plot(xs, eff, color=pal.color(s.compressor), linestyle=ls, marker=marker,
                    label=f"{s.label} ({s.clock})")
        ax.axhline(100, color="0.4", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_ylim(bottom=0)

    fig, pn = facetted(col, {"workers"}, draw, "workers (count, log scale)",
                        f"scaling efficiency (%, {clock_of(col.runs)})", max_series=10,
                        single_width=7.2 if len(series(col, {"workers"})) > 6 else None)
    if len(fig.axes) == 1:
        fig.axes[0].set_title("Scaling efficiency")
    caption = ("Scaling efficiency: throughput with N workers divided by N times the single-worker throughput "
               f"(reference: {' / '.join(sorted(refs))}, with otherwise equal settings, so compression overhead "
               "counts against a compressor); 100% is linear scaling." + seed_note(series(col, {"workers"}))
               + pn.text() + " " + clock_caption(col.runs) + " " + fixed_caption(col, {"workers"}))
    return fig, " ".join(caption.split())
