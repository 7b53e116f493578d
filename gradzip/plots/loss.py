"""The loss figures: ``loss_steps`` and ``loss_time`` (training loss, smoothed, with the eval
points and the context-free references) and ``loss_vs_ratio`` (final eval loss against
compression ratio). Registered in :data:`gradzip.plots.figures.DRAW`."""

from __future__ import annotations

import numpy as np
from matplotlib.ticker import FuncFormatter

from gradzip.plots import style
from gradzip.plots.captions import clock_caption, clock_of, fixed_caption, seed_note
from gradzip.plots.grouping import Skip, facetted, mean_curve, series, smoothing_half_window
from gradzip.plots.results import Collection, LossTarget, Run, centred_mean, reference


def _loss_figure(col: Collection, pal: style.Palette, x: str, target: LossTarget | None):
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
            xs, raw, _, _ = mean_curve(runs, xs_of, raw_of)
            ax.plot(xs, raw, color=color, alpha=0.18, linewidth=0.8, linestyle=ls)
            xs, mean, lo, hi = mean_curve(runs, xs_of, lambda r: centred_mean(raw_of(r), half))
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
    fig, pn = facetted(col, set(), draw, xlabel, "MLM + NSP loss (nats)", sharey=True,
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
               + seed_note(groups) + pn.text() + " "
               + (clock_caption(col.runs) + " " if x == "time" else "") + fixed_caption(col))
    return fig, " ".join(caption.split())


def fig_loss_steps(col: Collection, pal: style.Palette, target: LossTarget | None = None):
    return _loss_figure(col, pal, "steps", target)


def fig_loss_time(col: Collection, pal: style.Palette, target: LossTarget | None = None):
    return _loss_figure(col, pal, "time", target)


def fig_loss_vs_ratio(col: Collection, pal: style.Palette, target: LossTarget | None = None):
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

    fig, pn = facetted(col, set(), draw, "compression ratio (fp32 bytes / bytes sent, log scale)",
                        "final eval loss (nats)", max_series=10,
                        single_width=7.2 if len(series(col)) > 6 else None)
    if len(fig.axes) == 1:
        fig.axes[0].set_title("Accuracy–bandwidth trade-off")
    caption = ("Final held-out loss (MLM + NSP) against compression ratio: further right sends less, lower is "
               "better; the dashed line is uncompressed fp32." + seed_note(series(col)) + pn.text() + " "
               + fixed_caption(col))
    return fig, " ".join(caption.split())
