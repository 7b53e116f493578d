"""The figures of ``gradzip plot``: each function draws one figure from a :class:`Collection` of runs.

A figure function returns ``(fig, auto_caption)`` or raises :class:`~gradzip.plots.grouping.Skip`
with the reason when the data has no variation along the figure's axis (e.g. a
throughput-vs-bandwidth figure from runs at one bandwidth). Runs that differ only by ``seed`` are
one *series* (:mod:`gradzip.plots.grouping`): curves show the seeds' mean (with a min–max band),
points the mean (with min–max error bars).

Every time axis says its clock: *modelled* (the ``sim`` backend's virtual clock: measured compute,
communication from the α–β cost model) or *measured* (real backends), from the metrics' ``clock``
(:mod:`gradzip.plots.captions`).

This module is the registry (:data:`DRAW`); the figures live by topic in :mod:`~gradzip.plots.loss`,
:mod:`~gradzip.plots.cost`, :mod:`~gradzip.plots.schedule`, :mod:`~gradzip.plots.scale`,
:mod:`~gradzip.plots.lowcomm`, :mod:`~gradzip.plots.paired_figure` and
:mod:`~gradzip.plots.metric_figures` (any metrics.jsonl field).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradzip.plots import style
from gradzip.plots.captions import clock_caption
from gradzip.plots.cost import fig_bytes_per_step, fig_scaling, fig_step_time, fig_throughput_bandwidth
from gradzip.plots.downstream import fig_downstream_vs_bytes
from gradzip.plots.grouping import Skip
from gradzip.plots.loss import fig_loss_steps, fig_loss_time, fig_loss_vs_ratio
from gradzip.plots.lowcomm import fig_loss_vs_bytes, fig_time_to_target
from gradzip.plots.metric_figures import fig_metric
from gradzip.plots.paired_figure import NotPaired, fig_delta_ci
from gradzip.plots.policy import fig_policy
from gradzip.plots.results import DEFAULT_METRIC_FIGURES, Collection, LossTarget, describe_where
from gradzip.plots.scale import fig_bytes_workers, fig_throughput_workers
from gradzip.plots.schedule import fig_schedule

TIME_FIGURES = {"loss_time", "throughput_bandwidth", "step_time", "schedule", "scaling", "time_to_target"}

DRAW: dict[str, Callable[..., Any]] = {
    "loss_steps": fig_loss_steps,
    "loss_time": fig_loss_time,
    "throughput_bandwidth": fig_throughput_bandwidth,
    "bytes_per_step": fig_bytes_per_step,
    "step_time": fig_step_time,
    "schedule": fig_schedule,
    "loss_vs_ratio": fig_loss_vs_ratio,
    "scaling": fig_scaling,
    "bytes_workers": fig_bytes_workers,
    "throughput_workers": fig_throughput_workers,
    "loss_vs_bytes": fig_loss_vs_bytes,
    "time_to_target": fig_time_to_target,
    "policy": fig_policy,
    "downstream_vs_bytes": fig_downstream_vs_bytes,
    "delta_ci": fig_delta_ci,
}


@dataclass
class Drawn:
    name: str
    paths: list[Path]
    caption: str


def draw_all(col: Collection, out_dir: Path, figures: list[str] | None = None,
             captions: dict[str, str] | None = None,
             target: LossTarget | None = None,
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
            # Any other name is the figure of one metrics.jsonl field.
            draw = DRAW.get(name) or functools.partial(fig_metric, name)
            fig, auto = draw(sub, pal, target)
        except Skip as e:
            if not (isinstance(e, NotPaired) and not figures):  # drawn by default only where it applies
                skipped.append((name, str(e)))
            continue
        caption = auto
        if (captions or {}).get(name):
            # The spec's caption, plus the clock sentence so every time axis says what it is.
            caption = captions[name].strip()
            if name in TIME_FIGURES or name.endswith("_time"):
                caption += " " + clock_caption(sub.runs)
        if where.get(name):
            caption += f" Drawn from the runs with {describe_where(where[name])} only."
        drawn.append(Drawn(name, style.save(fig, out_dir, name), caption))
    return drawn, skipped
