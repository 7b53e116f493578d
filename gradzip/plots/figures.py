"""The figures of ``gradzip plot``: each function draws one figure from a :class:`Collection` of runs.

A figure function returns ``(fig, auto_caption)`` or raises :class:`Skip` with the reason when the
data has no variation along the figure's axis (e.g. a throughput-vs-bandwidth figure from runs at
one bandwidth). Runs that differ only by ``seed`` are one *series*: curves show the seeds' mean
(with a min–max band), points the mean (with min–max error bars).

Every time axis says its clock: *modelled* (the ``sim`` backend's virtual clock: measured compute,
communication from the α–β cost model) or *measured* (real backends), from the metrics' ``clock``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.ticker import FuncFormatter

from gradzip.plots import style
from gradzip.plots.results import (
    DEFAULT_METRIC_FIGURES,
    NOT_BYTES_KEYS,
    Collection,
    Run,
    Target,
    centred_mean,
    describe_where,
    reference,
)

CLOCK_TEXT = {
    "modelled": "modelled (the sim backend's virtual clock: measured computation plus communication from "
                "the α–β cost model of the link)",
    "measured": "measured (wall-clock time of the real backend)",
}


TIME_FIGURES = {"loss_time", "throughput_bandwidth", "step_time", "schedule", "scaling", "time_to_target"}


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


def _fmt_value(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def series(col: Collection, exclude: set[str] = frozenset()) -> list[Series]:
    """Group runs into series: same compressor and same varying parameters except ``exclude`` and seed."""
    vary = [k for k in col.varying() if k not in exclude and k not in ("compressor", "seed")]
    out: dict[tuple, Series] = {}
    for r in col.runs:
        sec = ", ".join(f"{k}={_fmt_value(r.value(k))}" for k in vary)
        key = (r.compressor, sec)
        if key not in out:
            label = r.compressor + (f" · {sec}" if sec else "")
            out[key] = Series(label, r.compressor, sec, [])
        out[key].runs.append(r)
    return list(out.values())


def clock_of(runs: list[Run]) -> str:
    clocks = {r.clock for r in runs}
    return clocks.pop() if len(clocks) == 1 else "mixed"


def _clock_caption(runs: list[Run]) -> str:
    c = clock_of(runs)
    if c == "mixed":
        return "Time is modelled for some runs and measured for others; each label says which."
    return f"Time axis: {CLOCK_TEXT.get(c, c)}."


def _fixed_caption(col: Collection, skip: set[str] = frozenset()) -> str:
    keys = ("model", "backend", "workers", "bandwidth", "latency", "batch_size", "accumulation", "seq_len",
            "precision", "optimizer", "steps")
    fixed = col.fixed()
    parts = [f"{k}={_fmt_value(fixed[k])}" for k in keys if k in fixed and k not in skip]
    return f"Fixed: {', '.join(parts)}." if parts else ""


def _seed_note(groups: list[Series]) -> str:
    n = max(len({str(r.value("seed")) for r in s.runs}) for s in groups)
    return f" Each series is the mean of {n} seeds (band/bars: min–max)." if n > 1 else ""


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


def _facetted(col: Collection, exclude: set[str], draw: Callable[[Any, Collection], None], xlabel: str,
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
            title = ", ".join(f"{k}={_fmt_value(v)}" for k, v in ((pn.col_key, cv), (pn.row_key, rv)) if k)
            if title:
                ax.set_title(title)
    if nr * nc == 1:
        axes[0].set_xlabel(xlabel)
        axes[0].set_ylabel(ylabel)
        _legend(axes[0], len(axes[0].get_legend_handles_labels()[0]))
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


def _legend(ax, n: int) -> None:
    if n > 6:
        style.legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        style.legend(ax)


def _mean_curve(runs: list[Run], xs_of: Callable[[Run], list[float]],
                ys_of: Callable[[Run], list[float]]) -> tuple[np.ndarray, ...]:
    """Mean, min and max over runs, truncated to the shortest run (seeds have equal step counts)."""
    n = min(len(ys_of(r)) for r in runs)
    xs = np.mean([xs_of(r)[:n] for r in runs], axis=0)
    ys = np.array([ys_of(r)[:n] for r in runs])
    return xs, ys.mean(axis=0), ys.min(axis=0), ys.max(axis=0)


def smoothing_half_window(steps: int) -> int:
    """Half-width of the loss curves' moving average: about 2% of the run on each side (200 steps: 9 points)."""
    return max(0, round(steps / 50))


def _loss_figure(col: Collection, pal: style.Palette, x: str, target: Target | None):
    if not any(r.train_rows for r in col.runs):
        raise Skip("no metrics.jsonl rows with a loss")
    half = smoothing_half_window(max(len(r.train_rows) for r in col.runs))

    def xs_of(r: Run) -> list[float]:
        return [float(m["step"]) for m in r.train_rows] if x == "steps" else r.times()

    def raw_of(r: Run) -> list[float]:
        return [float(m["loss"]) for m in r.train_rows]

    def draw(ax, sub: Collection) -> None:
        for s in series(sub):
            runs = [r for r in s.runs if r.train_rows]
            if not runs:
                continue
            color, (ls, marker) = pal.color(s.compressor), pal.style(s.secondary)
            xs, raw, _, _ = _mean_curve(runs, xs_of, raw_of)
            ax.plot(xs, raw, color=color, alpha=0.18, linewidth=0.8, linestyle=ls)
            xs, mean, lo, hi = _mean_curve(runs, xs_of, lambda r: centred_mean(raw_of(r), half))
            ax.plot(xs, mean, color=color, linestyle=ls, label=s.label + (f" ({s.clock})" if x == "time" else ""))
            if len(runs) > 1:
                ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)
            ev = [r.eval_points() for r in runs]
            if all(e[0] for e in ev):
                n = min(len(e[0]) for e in ev)
                ex = np.mean([(e[0] if x == "steps" else e[1])[:n] for e in ev], axis=0)
                ey = np.mean([e[2][:n] for e in ev], axis=0)
                ax.plot(ex, ey, linestyle="none", marker=marker, color=color, markerfacecolor="white",
                        markeredgewidth=1.2)
        if target:
            ax.axhline(target.loss, color="0.4", linewidth=0.8, linestyle="--", label=f"target {target.loss:g}")
        for (value, label), ls in zip(ref, (":", "-.")):
            ax.axhline(value, color="0.55", linewidth=0.9, linestyle=ls, label=label)

    ref = reference(col.runs, "loss")
    clock = clock_of(col.runs)
    xlabel = "optimizer step (count)" if x == "steps" else f"wall-clock time (s, {clock})"
    fig, pn = _facetted(col, set(), draw, xlabel, "MLM + NSP loss (nats)", sharey=True,
                        single_width=7.2 if len(series(col)) > 6 else None)
    if len(fig.axes) == 1:
        fig.axes[0].set_title("Loss against steps" if x == "steps" else f"Loss against time ({clock})")
    what = "optimizer steps" if x == "steps" else "cumulative wall-clock time"
    groups = series(col)
    caption = (f"Training loss against {what}: lines are the training loss smoothed by a centred moving average "
               f"over {2 * half + 1} steps, faint lines the raw loss, open markers the held-out eval loss."
               + (f" Dotted: the {ref[0][1]}, the loss of a model that predicts masked tokens from their corpus "
                  "frequency and guesses next sentences at chance." if ref else "")
               + (f" Dash-dotted: the {ref[1][1]}: below it a model uses the context (above it, it may only "
                  "copy the visible input token of BERT's unchanged and random positions)." if len(ref) > 1 else "")
               + _seed_note(groups) + pn.text() + " "
               + (_clock_caption(col.runs) + " " if x == "time" else "") + _fixed_caption(col))
    return fig, " ".join(caption.split())


def fig_loss_steps(col: Collection, pal: style.Palette, target: Target | None = None):
    return _loss_figure(col, pal, "steps", target)


def fig_loss_time(col: Collection, pal: style.Palette, target: Target | None = None):
    return _loss_figure(col, pal, "time", target)


def _by(runs: list[Run], key: Callable[[Run], float | None], value: Callable[[Run], float | None]):
    """{x: (mean, min, max)} of ``value`` grouped by ``key`` (None values dropped)."""
    acc: dict[float, list[float]] = {}
    for r in runs:
        k, v = key(r), value(r)
        if k is not None and v is not None:
            acc.setdefault(k, []).append(v)
    return {k: (float(np.mean(v)), min(v), max(v)) for k, v in sorted(acc.items())}


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


def fig_throughput_bandwidth(col: Collection, pal: style.Palette, target: Target | None = None):
    if len({r.bandwidth_bps for r in col.runs if r.bandwidth_bps}) < 2:
        raise Skip("the runs have fewer than two bandwidths")
    notes: list[str] = []

    def draw(ax, sub: Collection) -> None:
        curves: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
        for s in series(sub, exclude={"bandwidth"}):
            pts = _by(s.runs, lambda r: r.bandwidth_bps, lambda r: r.samples_per_s)
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
        where = ", ".join(f"{k}={_fmt_value(v)}" for k, v in _panel_values(sub, col).items())
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
    fig, pn = _facetted(col, {"bandwidth"}, draw, "link bandwidth (log scale)",
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
               + _seed_note(groups) + pn.text() + " "
               + _clock_caption(col.runs) + " " + _fixed_caption(col, {"bandwidth"}))
    return fig, " ".join(caption.split())


def _panel_values(sub: Collection, col: Collection) -> dict[str, Any]:
    """Parameters that vary in ``col`` but are constant in the panel ``sub`` (the panel's title)."""
    if sub is col:
        return {}
    inner = set(sub.varying())
    return {k: sub.runs[0].value(k) for k in col.varying() if k not in inner and k not in ("compressor", "seed")
            and k != "bandwidth"}


def fig_bytes_per_step(col: Collection, pal: style.Palette, target: Target | None = None):
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
               + _fixed_caption(col, NOT_BYTES_KEYS))
    return fig, caption.strip()


PHASE_LABELS = (("compute", "compute"), ("compress", "compression"), ("comm", "exposed communication"),
                ("opt", "optimizer"))


def fig_step_time(col: Collection, pal: style.Palette, target: Target | None = None):
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
        ax.set_xticks(xs, [s.label for s in groups], rotation=35, ha="right", fontsize=7.5)
        ax.grid(axis="x", visible=False)

    n = len(series(col))
    fig, pn = _facetted(col, set(), draw, "compressor", f"time per step ({unit}, {clock_of(runs)})",
                        max_series=12, sharey=True, single_width=max(5.0, 0.6 * n + 2))
    if len(fig.axes) == 1:
        fig.axes[0].set_title("Where a step's time goes")
    caption = ("Mean time of an optimizer step (first step excluded) split into computation (forward and backward), "
               "compression (compress + decompress), communication not hidden behind the backward pass "
               "(exposed) and the optimizer step." + pn.text() + " " + _clock_caption(runs) + " " + _fixed_caption(col))
    return fig, " ".join(caption.split())


def fig_loss_vs_ratio(col: Collection, pal: style.Palette, target: Target | None = None):
    runs = [r for r in col.runs if r.final_eval_loss is not None and r.compression_ratio]
    if len({round(r.compression_ratio, 6) for r in runs}) < 2:
        raise Skip("fewer than two distinct compression ratios with a final eval loss")
    col = Collection(col.root, runs, col.sweep)

    def draw(ax, sub: Collection) -> None:
        for s in series(sub):
            xs = [r.compression_ratio for r in s.runs]
            ys = [r.final_eval_loss for r in s.runs]
            x, y = float(np.mean(xs)), float(np.mean(ys))
            _, marker = pal.style(s.secondary)
            yerr = [[y - min(ys)], [max(ys) - y]] if len(ys) > 1 else None
            ax.errorbar([x], [y], yerr=yerr, marker=marker, markersize=7, color=pal.color(s.compressor),
                        linestyle="none", capsize=3, label=s.label)
        base = [r.final_eval_loss for r in sub.runs if r.compressor_family == "none"]
        if base:
            ax.axhline(float(np.mean(base)), color="0.3", linewidth=0.8, linestyle="--", label="none (fp32)")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}×"))

    fig, pn = _facetted(col, set(), draw, "compression ratio (fp32 bytes / bytes sent, log scale)",
                        "final eval loss (nats)", max_series=10,
                        single_width=7.2 if len(series(col)) > 6 else None)
    if len(fig.axes) == 1:
        fig.axes[0].set_title("Accuracy–bandwidth trade-off")
    caption = ("Final held-out loss (MLM + NSP) against compression ratio: further right sends less, lower is "
               "better; the dashed line is uncompressed fp32." + _seed_note(series(col)) + pn.text() + " "
               + _fixed_caption(col))
    return fig, " ".join(caption.split())


def fig_scaling(col: Collection, pal: style.Palette, target: Target | None = None):
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
        base = {s.secondary: _by(s.runs, lambda r: r.workers, lambda r: r.samples_per_s)
                for s in groups if s.compressor.split(":")[0].strip() == "none"}
        for s in groups:
            pts = _by(s.runs, lambda r: r.workers, lambda r: r.samples_per_s)
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

    fig, pn = _facetted(col, {"workers"}, draw, "workers (count, log scale)",
                        f"scaling efficiency (%, {clock_of(col.runs)})", max_series=10,
                        single_width=7.2 if len(series(col, {"workers"})) > 6 else None)
    if len(fig.axes) == 1:
        fig.axes[0].set_title("Scaling efficiency")
    caption = ("Scaling efficiency: throughput with N workers divided by N times the single-worker throughput "
               f"(reference: {' / '.join(sorted(refs))}, with otherwise equal settings, so compression overhead "
               "counts against a compressor); 100% is linear scaling." + _seed_note(series(col, {"workers"}))
               + pn.text() + " " + _clock_caption(col.runs) + " " + _fixed_caption(col, {"workers"}))
    return fig, " ".join(caption.split())


def _scale(name: str) -> Callable[..., Any]:
    """A figure of :mod:`gradzip.plots.scale`, imported when first drawn (it builds on this module)."""
    def draw(*args: Any) -> Any:
        from gradzip.plots import scale
        return getattr(scale, name)(*args)
    return draw


def _lowcomm(name: str) -> Callable[..., Any]:
    """A figure of :mod:`gradzip.plots.lowcomm`, imported when first drawn (it builds on this module)."""
    def draw(*args: Any) -> Any:
        from gradzip.plots import lowcomm
        return getattr(lowcomm, name)(*args)
    return draw


def _schedule(*args: Any) -> Any:
    """Figure ``schedule`` (:mod:`gradzip.plots.schedule`), imported when first drawn."""
    from gradzip.plots.schedule import fig_schedule
    return fig_schedule(*args)


def _metric(name: str) -> Callable[..., Any]:
    """The figure of one metrics.jsonl field (:mod:`gradzip.plots.metric_figures`)."""
    def draw(*args: Any) -> Any:
        from gradzip.plots.metric_figures import fig_metric
        return fig_metric(name, *args)
    return draw


DRAW: dict[str, Callable[..., Any]] = {
    "loss_steps": fig_loss_steps,
    "loss_time": fig_loss_time,
    "throughput_bandwidth": fig_throughput_bandwidth,
    "bytes_per_step": fig_bytes_per_step,
    "step_time": fig_step_time,
    "schedule": _schedule,
    "loss_vs_ratio": fig_loss_vs_ratio,
    "scaling": fig_scaling,
    "bytes_workers": _scale("fig_bytes_workers"),
    "throughput_workers": _scale("fig_throughput_workers"),
    "loss_vs_bytes": _lowcomm("fig_loss_vs_bytes"),
    "time_to_target": _lowcomm("fig_time_to_target"),
}


@dataclass
class Drawn:
    name: str
    paths: list[Path]
    caption: str


def draw_all(col: Collection, out_dir: Path, figures: list[str] | None = None,
             captions: dict[str, str] | None = None,
             target: Target | None = None,
             where: dict[str, dict[str, Any]] | None = None) -> tuple[list[Drawn], list[tuple[str, str]]]:
    """Draw the chosen figures (default: all) into ``out_dir``; returns (drawn, [(skipped, reason)]).

    ``where`` (default: the sweep spec's ``[plot.where]``) draws a figure from the matching runs only.
    """
    where = (col.spec.get("plot") or {}).get("where") or {} if where is None else where
    pal = style.Palette()
    # Colours follow the runs' order, so `none` is black and the rest keep the spec's order.
    for r in col.runs:
        pal.color(r.compressor)
    drawn, skipped = [], []
    for name in figures or [*DRAW, *DEFAULT_METRIC_FIGURES]:
        sub = col.select(where.get(name))
        try:
            if not sub.runs:
                raise Skip(f"no run matches [plot.where] {describe_where(where[name])}")
            fig, auto = DRAW.get(name, _metric(name))(sub, pal, target)
        except Skip as e:
            skipped.append((name, str(e)))
            continue
        caption = auto
        if (captions or {}).get(name):
            # The spec's caption, plus the clock sentence so every time axis says what it is.
            caption = captions[name].strip()
            if name in TIME_FIGURES or name.endswith("_time"):
                caption += " " + _clock_caption(sub.runs)
        if where.get(name):
            caption += f" Drawn from the runs with {describe_where(where[name])} only."
        drawn.append(Drawn(name, style.save(fig, out_dir, name), caption))
    return drawn, skipped
