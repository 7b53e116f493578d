"""The tables of an experiment spec besides ``[base]`` and ``[grid]``: ``[target]``, ``[plot]``
(with ``[plot.where]``) and ``repeats``, and the checks every table shares. Each check returns the
table's validated value or raises :class:`~gradzip.errors.SpecError` with one line naming the
file and the key (:mod:`gradzip.experiments.spec` reads the spec and expands its grid)."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradzip.errors import SpecError
from gradzip.plots.results import FIGURE_CHOICES, is_figure
from gradzip.plots.retime import bandwidth_columns
from gradzip.training.config import TrainConfig

REPEATS_KEYS = {"n", "where"}
MAX_REPEATS = 100
TARGET_KEYS = {"loss", "metric", "smoothing", "bandwidths"}
PLOT_KEYS = {"figures", "captions", "title", "where"}
RUNNER_KEYS = {"out", "resume"}  # set per cell by the runner
NOT_IN_SPECS = RUNNER_KEYS | {"config"}  # `config` names a file for `gradzip train`; a spec is that file
TARGET_METRICS = ("loss", "eval_loss")


@dataclass
class Target:
    """Time-to-target definition: the first step where ``metric`` is at or below ``loss``.

    ``metric="loss"`` uses the training loss smoothed by an exponential moving average
    (bias-corrected; ``smoothing`` is its decay, 0 = raw); ``"eval_loss"`` uses the evaluations only, so
    its resolution is ``eval_every`` steps.

    ``bandwidths`` (as written: ``"100mbit"``, or a number of bits/s) add, per bandwidth, the time
    to target modelled by re-timing each run at that link (:mod:`gradzip.plots.retime`): a results
    column ``time_to_target_<B>_s`` and the ``time_to_target`` figure.
    """

    loss: float
    metric: str = "loss"
    smoothing: float = 0.9
    bandwidths: list[str | float] = field(default_factory=list)


@dataclass
class PlotOptions:
    figures: list[str] | None = None  # None: every figure the data supports
    captions: dict[str, str] = field(default_factory=dict)
    title: str | None = None
    where: dict[str, dict[str, Any]] = field(default_factory=dict)  # figure -> {key: value or [values]}


def spec_train_keys() -> set[str]:
    """The ``gradzip train`` keys a spec may set: all but those the runner sets per cell."""
    return {f.name for f in dataclasses.fields(TrainConfig)} - NOT_IN_SPECS


def check_keys(where: str, table: dict[str, Any], allowed: set[str], src: Path) -> None:
    for key in table:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), sorted(allowed), n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"valid keys: {', '.join(sorted(allowed))}"
            raise SpecError(f"{src}: unknown key {key!r} in {where}; {hint}")


def expect(value: Any, types: type | tuple[type, ...], what: str, src: Path, hint: str) -> None:
    # bool is an int in Python; a TOML `true` is never a valid number here.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise SpecError(f"{src}: {what} must be {hint}, got {type(value).__name__} {value!r}")


def _as_tuple(t: type | tuple[type, ...]) -> tuple[type, ...]:
    return t if isinstance(t, tuple) else (t,)


def check_target(t: Any, src: Path) -> Target:
    """The ``[target]`` table: the loss to reach, the metric, its smoothing and the bandwidth columns."""
    expect(t, dict, "[target]", src, "a table, e.g. [target] loss = 6.5")
    check_keys("[target]", t, TARGET_KEYS, src)
    if "loss" not in t:
        raise SpecError(f"{src}: [target] needs 'loss', the loss to reach, e.g. loss = 6.5")
    expect(t["loss"], (int, float), "[target] 'loss'", src, "a number")
    metric = t.get("metric", "loss")
    if metric not in TARGET_METRICS:
        raise SpecError(f"{src}: [target] metric {metric!r} is not one of {', '.join(TARGET_METRICS)}")
    smoothing = t.get("smoothing", 0.9)
    expect(smoothing, (int, float), "[target] 'smoothing'", src, "a number in [0, 1)")
    if not 0 <= smoothing < 1:
        raise SpecError(f"{src}: [target] smoothing must be in [0, 1), got {smoothing}")
    bandwidths = t.get("bandwidths", [])
    expect(bandwidths, list, "[target] 'bandwidths'", src, 'a list of bandwidths, e.g. ["100mbit", "1gbit"]')
    try:
        bandwidth_columns(bandwidths)
    except SpecError as e:
        raise SpecError(f"{src}: [target] bandwidths: {e}") from None
    return Target(float(t["loss"]), metric, float(smoothing), list(bandwidths))


def check_plot(p: Any, src: Path) -> PlotOptions:
    """The ``[plot]`` table: figures, captions, title and each figure's ``where``."""
    plot = PlotOptions()
    expect(p, dict, "[plot]", src, "a table")
    check_keys("[plot]", p, PLOT_KEYS, src)
    if "figures" in p:
        figs = p["figures"]
        expect(figs, list, "[plot] 'figures'", src, f"a list of figure names ({FIGURE_CHOICES})")
        for fig in figs:
            if not is_figure(fig):
                raise SpecError(f"{src}: [plot] unknown figure {fig!r}; valid: {FIGURE_CHOICES}")
        plot.figures = list(figs)
    caps = p.get("captions", {})
    expect(caps, dict, "[plot.captions]", src, "a table of figure name = caption")
    for fig, text in caps.items():
        if not is_figure(fig):
            raise SpecError(f"{src}: [plot.captions] unknown figure {fig!r}; valid: {FIGURE_CHOICES}")
        expect(text, str, f"[plot.captions] {fig!r}", src, "a string")
    plot.captions = dict(caps)
    if "title" in p:
        expect(p["title"], str, "[plot] 'title'", src, "a string")
        plot.title = p["title"]
    plot.where = check_where(p.get("where", {}), src)
    return plot


def check_repeats(value: Any, grid: dict[str, Any], src: Path) -> tuple[int, dict[str, Any] | None]:
    """``repeats = N`` or ``repeats = {n = N, where = {...}}`` -> (N, where or None)."""
    where = None
    if isinstance(value, dict):
        check_keys("repeats", value, REPEATS_KEYS, src)
        if "n" not in value:
            raise SpecError(f"{src}: repeats needs 'n', the number of seeds, e.g. repeats = {{ n = 3 }}")
        if "where" in value:
            where = check_where({"loss_steps": value["where"]}, src)["loss_steps"]
        value = value["n"]
    expect(value, int, "'repeats'", src, f"a whole number of seeds from 1 to {MAX_REPEATS}")
    if not 1 <= value <= MAX_REPEATS:
        raise SpecError(f"{src}: 'repeats' must be from 1 to {MAX_REPEATS} seeds, got {value}")
    if value > 1 and "seed" in grid:
        raise SpecError(f"{src}: seed is a [grid] axis and repeats is set; give the seeds in one place")
    return value, where


def check_where(where: Any, src: Path) -> dict[str, dict[str, Any]]:
    """``[plot.where]``: figure name -> non-empty table of train key -> value or non-empty list of values."""
    expect(where, dict, "[plot.where]", src, "a table of figure name = {key = value, ...}")
    keys = spec_train_keys()
    out: dict[str, dict[str, Any]] = {}
    for fig, table in where.items():
        if not is_figure(fig):
            raise SpecError(f"{src}: [plot.where] unknown figure {fig!r}; valid: {FIGURE_CHOICES}")
        expect(table, dict, f"[plot.where] {fig!r}", src, "a table of train keys, e.g. { workers = 8 }")
        if not table:
            raise SpecError(f"{src}: [plot.where] {fig!r} is empty; give keys to select runs, e.g. {{ workers = 8 }}, "
                            "or remove it")
        check_keys(f"[plot.where] {fig!r}", table, keys, src)
        for key, value in table.items():
            what = f"[plot.where] {fig!r} key {key!r}"
            if isinstance(value, list):
                if not value:
                    raise SpecError(f"{src}: {what} is an empty list; give at least one value")
                for v in value:
                    expect(v, (str, int, float, bool), f"{what} value", src, "a string, number or boolean")
            else:
                expect(value, (str, int, float, bool), what, src, "a string, number or boolean, or a list of them")
        out[fig] = dict(table)
    return out
