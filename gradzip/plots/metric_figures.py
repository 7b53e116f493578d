"""Figures of any metrics.jsonl field: ``<metric>_steps``, ``<metric>_time`` and ``<metric>_bytes``
(against the cumulative bytes a worker sent, log scale; e.g. ``eval_mlm_acc_steps``,
``grad_norm_time``, ``eval_loss_bytes``; the fields: :data:`gradzip.plots.results.METRICS`).

One line per series (the mean over its seeds, with a min–max band when there are several). Eval
metrics are drawn at their eval steps with markers; per-step losses and the gradient norm are
smoothed like the loss figures. Where the context-free reference of a metric is known from the
runs' summaries (the corpus's unigram entropy for the MLM loss, the most frequent token's rate for
masked-token accuracy, chance for NSP accuracy), it is a dashed line.
"""

from __future__ import annotations

from gradzip.plots import style
from gradzip.plots.captions import clock_caption, clock_of, fixed_caption, seed_note
from gradzip.plots.grouping import Skip, facetted, mean_curve, series, smoothing_half_window
from gradzip.plots.results import METRICS, Collection, LossTarget, Run, centred_mean, metric_figure, reference

SMOOTHED = {"loss", "mlm_loss", "nsp_loss", "grad_norm"}


def fig_metric(name: str, col: Collection, pal: style.Palette, target: LossTarget | None = None):
    parsed = metric_figure(name)
    if parsed is None:
        raise Skip(f"{name!r} names no metric")
    metric, x = parsed

    def rows(r: Run) -> list[dict]:
        return [m for m in r.metrics if m.get(metric) is not None and m.get("step") is not None]

    runs = [r for r in col.runs if rows(r)]
    if not runs:
        raise Skip(f"no metrics.jsonl rows with {metric}")
    col = Collection(col.root, runs, col.sweep)
    half = smoothing_half_window(max(len(rows(r)) for r in runs)) if metric in SMOOTHED else 0
    sparse = metric.startswith("eval_")

    def xs_of(r: Run) -> list[float]:
        if x == "bytes":  # cumulative over every step, read at the metric's steps (MB)
            total, upto = 0, {}
            for m in r.metrics:
                total += int(m.get("bytes_sent") or 0)
                upto[m.get("step")] = total / 1e6
            return [upto[m["step"]] for m in rows(r)]
        return [float(m["step"] if x == "steps" else m.get("wall_s", 0.0)) for m in rows(r)]

    def ys_of(r: Run) -> list[float]:
        return centred_mean([float(m[metric]) for m in rows(r)], half)

    ref = reference(runs, metric)

    def draw(ax, sub: Collection) -> None:
        for s in series(sub):
            group = [r for r in s.runs if rows(r)]
            if not group:
                continue
            color, (ls, marker) = pal.color(s.compressor), pal.style(s.secondary)
            xs, mean, lo, hi = mean_curve(group, xs_of, ys_of)
            ax.plot(xs, mean, color=color, linestyle=ls, marker=marker if sparse else None, markersize=4,
                    label=s.label + (f" ({s.clock})" if x == "time" else ""))
            if len(group) > 1:
                ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)
        for (value, label), ls in zip(ref, ("--", ":")):
            ax.axhline(value, color="0.35", linewidth=0.9, linestyle=ls, label=label)
        if metric.startswith("bytes"):
            ax.set_yscale("symlog")
        if x == "bytes":
            ax.set_xscale("log")

    clock = clock_of(runs)
    xlabel = {"steps": "optimizer step (count)", "bytes": "cumulative bytes sent per worker (MB, log scale)"}.get(
        x, f"wall-clock time (s, {clock})")
    fig, pn = facetted(col, set(), draw, xlabel, METRICS[metric],
                        single_width=7.2 if len(series(col)) > 6 else None)
    if len(fig.axes) == 1:
        fig.axes[0].set_title(f"{METRICS[metric]} against {x}")
    caption = (f"{METRICS[metric][0].upper() + METRICS[metric][1:]} ({metric} in metrics.jsonl) against "
               + {"steps": "optimizer steps", "bytes": "the cumulative bytes each worker sent (bytes_sent)"}.get(
                   x, "cumulative wall-clock time")
               + (f", smoothed by a centred moving average over {2 * half + 1} points" if half else "")
               + (", at each evaluation" if sparse else "") + "."
               + "".join(f" {how}: {label}." for how, (_, label) in zip(("Dashed", "Dotted"), ref))
               + seed_note(series(col)) + pn.text() + " "
               + (clock_caption(runs) + " " if x == "time" else "") + fixed_caption(col))
    return fig, " ".join(caption.split())

