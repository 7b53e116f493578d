"""Experiment specs: a TOML file with a base training configuration and grid axes.

Format (read with the standard library's :mod:`tomllib`)::

    name = "quickstart"                       # optional; default: the file's stem
    description = "five compressors, 4 sim workers at 1 Gbit/s"   # optional, one line

    [base]                                    # same keys as `gradzip train` (and its --config file)
    model = "bert-tiny"
    backend = "sim"
    workers = 4
    steps = 200

    [grid]                                    # axes; the cells are their cartesian product
    compressor = ["none", "fp16", "topk:ratio=0.01,ef=true"]
    bandwidth = ["100mbit", "1gbit"]
    seed = [0, 1]
    # An axis of tables sets several keys together (not a product of them); `label` names the value.
    # method = [{compressor = "none"}, {label = "fp32-acc4", compressor = "none", accumulation = 4}]

    repeats = 3                               # optional: every cell with seeds seed, seed+1, seed+2
    # or only some cells (the others run once, with [base]'s seed):
    # repeats = { n = 3, where = { compressor = ["none", "fp16"] } }

    [target]                                  # optional: time-to-target column and figures
    loss = 6.5
    metric = "loss"                           # "loss" (EMA-smoothed training loss) or "eval_loss"
    bandwidths = ["100mbit", "1gbit"]         # optional: also the time to target modelled at these links

    [plot]                                    # optional
    figures = ["loss_steps", "loss_time"]     # default: every figure the data supports
    [plot.captions]
    loss_steps = "Training loss of each compressor."
    [plot.where]                              # optional: draw a figure from some of the cells only
    loss_steps = { workers = 8, compressor = ["onebit", "onebit:exchange=twophase"] }

    [downstream]                              # optional: export and fine-tune every cell
    task = "keywords"                         # (gradzip.experiments.downstream)
    seeds = 3

Contract:

- Every cell's configuration (base updated with the cell's grid values) is validated through
  ``TrainConfig.from_dict`` when the spec is loaded, so a bad value fails before any cell runs.
- ``out`` and ``resume`` are set by the sweep runner and may not appear in a spec (nor ``config``).
- A key is set in one place only: ``[base]`` or one grid axis.
- ``netem_trace`` (a real-backend cell in the testbed): a relative path is read from the spec
  file's directory; a name that is no file there is a shipped trace (:func:`trace_for_spec`).
- ``[plot.where]`` maps a figure name to a table of train keys, each with a value or a list of
  values: that figure is drawn from the runs whose value of every key is the value or one of the
  list's (the value as written in the grid, else the cell's resolved configuration; numbers compare
  by value, ``8`` = ``8.0``; see :func:`gradzip.plots.results.matches_where`); other figures use
  every run. Each table must match at least one cell; its caption says which runs it shows.
- Errors are :class:`~gradzip.errors.SpecError` with one line naming the file and the key.
- A cell's directory name is derived from its grid values only (stable across runs of the same
  spec, so a re-run finds finished cells), e.g.
  ``compressor=topk-ratio=0.01-ef=true__bandwidth=1gbit__seed=0``; names longer than
  :data:`MAX_NAME` characters are shortened and end in a hash of the full name.
- ``repeats`` runs a cell under several seeds: ``seed`` (from ``[base]``, default 0) plus 0, 1, ...
  Cells run seed by seed (every configuration's first seed, then the second ones, ...).
  Each cell's name then ends in ``__seed=S`` and its ``seed`` is one of its grid values, so
  tables and figures aggregate over it (:mod:`gradzip.plots.seeds`). ``seed`` may not also be a
  grid axis. ``where`` selects cells like ``[plot.where]`` and must match at least one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradzip.errors import GradzipError, SpecError
from gradzip.experiments.downstream import Downstream, parse_downstream
from gradzip.experiments.spec_tables import (
    NOT_IN_SPECS,
    PlotOptions,
    Target,
    check_keys,
    check_plot,
    check_repeats,
    check_target,
    expect,
    spec_train_keys,
)
from gradzip.plots.results import describe_where, matches_where
from gradzip.training.config import TrainConfig

MAX_NAME = 120
TOP_KEYS = {"name", "description", "base", "grid", "target", "plot", "repeats", "downstream"}


def trace_for_spec(config: dict[str, Any], src: Path) -> dict[str, Any]:
    """A relative ``netem_trace`` that names a file in the spec's directory: that file's absolute
    path; anything else as written (a shipped trace's name, or an error at validation)."""
    value = config.get("netem_trace")
    if isinstance(value, str) and value and not Path(value).is_absolute():
        near = src.resolve().parent / value
        if near.is_file():
            return {**config, "netem_trace": str(near)}
    return config


def netem_for_cell(config: dict[str, Any]) -> dict[str, Any]:
    """Sweep hook: a cell with a real backend (``gloo``, ``mpi``) that sets ``bandwidth`` and no
    ``netem`` runs in the testbed, ``netem = "<hosts>:<bandwidth>"`` with hosts = ``workers``, or
    ``workers // ranks_per_node`` when the cell sets ``ranks_per_node`` (that many ranks on each
    emulated host; SpecError unless it divides ``workers``). The ``sim`` backend models the
    bandwidth instead; ``latency`` stays a ``sim`` setting: netem's delay is per packet."""
    if config.get("backend") in ("gloo", "mpi") and "bandwidth" in config and not config.get("netem"):
        workers = config.get("workers", TrainConfig.workers)
        per_node = config.get("ranks_per_node")
        hosts = workers
        if isinstance(per_node, int) and isinstance(workers, int) and per_node >= 1:  # else: validation names it
            if workers % per_node:
                raise SpecError(f"workers = {workers} is not a multiple of ranks_per_node = {per_node}: a testbed "
                                "cell runs ranks_per_node ranks on each of workers / ranks_per_node hosts")
            hosts = workers // per_node
        return {**config, "netem": f"{hosts}:{config['bandwidth']}"}
    return config


@dataclass
class Cell:
    """One point of the grid: its grid values, its full train configuration and its directory name."""

    params: dict[str, Any]
    config: dict[str, Any]
    name: str


@dataclass
class Spec:
    path: Path
    name: str
    description: str
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    target: Target | None = None
    plot: PlotOptions = field(default_factory=PlotOptions)
    repeats: int = 1
    repeats_where: dict[str, Any] | None = None  # None: every cell is repeated
    cells: list[Cell] = field(default_factory=list)
    downstream: Downstream | None = None  # [downstream]: fine-tune every cell (gradzip.experiments.downstream)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "path": str(self.path),
            "base": self.base,
            "grid": self.grid,
            "target": dataclasses.asdict(self.target) if self.target else None,
            "plot": dataclasses.asdict(self.plot),
            "repeats": {"n": self.repeats, "where": self.repeats_where},
        }


# -- naming ---------------------------------------------------------------------------------

def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _safe(text: str) -> str:
    """Filesystem-safe on Linux, macOS and Windows: keep ``[A-Za-z0-9._=+-]``, the rest -> '-'."""
    text = re.sub(r"[^A-Za-z0-9._=+-]+", "-", text.replace(":", "-").replace(",", "-"))
    return re.sub(r"-{2,}", "-", text).strip("-.") or "x"


def cell_name(params: dict[str, Any]) -> str:
    """Directory name of a cell from its grid values, in the grid's axis order."""
    return cell_name_from(list(params), list(params.values()))


def cell_name_from(axes: list[str], values: list[Any]) -> str:
    full = "__".join(_axis_text(a, v) for a, v in zip(axes, values))
    if len(full) <= MAX_NAME:
        return full
    digest = hashlib.sha1(full.encode()).hexdigest()[:10]
    return full[: MAX_NAME - 11].rstrip("-_=.") + "-" + digest


# -- loading --------------------------------------------------------------------------------

def _check_bundles(axis: str, values: list[Any], train_keys: set[str], src: Path) -> set[str]:
    """An axis of tables (``method = [{compressor = "none", accumulation = 2}, ...]``): every value is a
    table of train keys, plus an optional ``label`` used in the cell's directory name."""
    if axis in train_keys:
        raise SpecError(f"{src}: [grid] axis {axis!r} is a train key, so its values must be plain values, not "
                        "tables; name an axis of tables after what it varies, e.g. method = [{...}, {...}]")
    keys: set[str] = set()
    for v in values:
        expect(v, dict, f"[grid] axis {axis!r} value", src,
                "a table like every other value of this axis, e.g. {compressor = \"none\", accumulation = 2}")
        if not v or set(v) == {"label"}:
            raise SpecError(f"{src}: [grid] axis {axis!r} has an empty table; give train keys, e.g. {{seed = 1}}")
        for k in v:
            if k in NOT_IN_SPECS:
                raise SpecError(f"{src}: [grid] axis {axis!r}: key {k!r} is not allowed in a spec; remove it")
        check_keys(f"[grid] axis {axis!r}", v, train_keys | {"label"}, src)
        for k, x in v.items():
            expect(x, (str, int, float, bool), f"[grid] {axis!r} key {k!r}", src, "a string, number or boolean")
        keys |= set(v) - {"label"}
    return keys


def _axis_text(axis: str, value: Any) -> str:
    """The part of a cell's directory name that one axis contributes."""
    if isinstance(value, dict):
        if "label" in value:
            return f"{_safe(axis)}={_safe(str(value['label']))}"
        return "+".join(f"{_safe(k)}={_safe(_value_text(x))}" for k, x in value.items())
    return f"{_safe(axis)}={_safe(_value_text(value))}"


def validate_config(config: dict[str, Any], src: Path, where: str) -> Any:
    """Run ``TrainConfig.from_dict``; its one-line error names the file and the cell."""
    source = f"{src}: {where}"
    try:
        return TrainConfig.from_dict(config, source=source)
    except (GradzipError, TypeError, ValueError) as e:  # the latter two: a validator that forgot to wrap
        msg = str(e)
        raise SpecError(msg if msg.startswith(str(src)) else f"{source}: {msg}") from None


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file; every cell is expanded and validated (see module doc)."""
    src = Path(path)
    if not src.is_file():
        raise SpecError(f"spec file {str(src)!r} not found (give the path to a .toml file)")
    try:
        with open(src, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{src}: not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{src}: not a text file (a spec is UTF-8 TOML)") from None
    return parse_spec(raw, src)


def parse_spec(raw: dict[str, Any], src: Path) -> Spec:
    """Validate an already-parsed TOML document (``src`` is used in messages)."""
    check_keys("the spec's top level", raw, TOP_KEYS, src)
    name = raw.get("name", src.stem)
    expect(name, str, "'name'", src, "a string")
    if not name.strip() or _safe(name) != name:
        raise SpecError(f"{src}: 'name' {name!r} must be a plain word (letters, digits, '.', '_', '-', '=')")
    description = raw.get("description", "")
    expect(description, str, "'description'", src, "a string")
    train_keys = spec_train_keys()
    base = _check_base(raw.get("base", {}), train_keys, src)
    grid = _check_grid(raw, base, train_keys, src)
    target = check_target(raw["target"], src) if "target" in raw else None
    plot = check_plot(raw["plot"], src) if "plot" in raw else PlotOptions()
    repeats, repeats_where = check_repeats(raw.get("repeats", 1), grid, src)
    base = trace_for_spec(base, src)
    checked = netem_for_cell(dict(base))  # a trace without netem yet: each cell checks it with its own
    validate_config(checked if checked.get("netem") else {**checked, "netem_trace": None}, src, "[base]")
    spec = Spec(src, name, description, dict(base), {k: list(v) for k, v in grid.items()}, target, plot,
                repeats, repeats_where)
    spec.cells = expand(spec)
    spec.downstream = parse_downstream(raw["downstream"], src) if "downstream" in raw else None
    defaults = TrainConfig()  # a key no cell sets has its default
    if repeats_where and len(spec.cells) == len(list(itertools.product(*spec.grid.values()))):
        raise SpecError(f"{src}: repeats where = {{{describe_where(repeats_where)}}} matches no cell of the grid")
    for fig, where in plot.where.items():
        if not any(matches_where(lambda k, c=c: c.config.get(k, getattr(defaults, k)), where) for c in spec.cells):
            raise SpecError(f"{src}: [plot.where] {fig} = {{{describe_where(where)}}} matches no cell of the grid")
    return spec


def _check_base(base: Any, train_keys: set[str], src: Path) -> dict[str, Any]:
    """The ``[base]`` table: training keys only, none of those the runner sets."""
    expect(base, dict, "[base]", src, "a table")
    for key in base:
        if key in NOT_IN_SPECS:
            raise SpecError(f"{src}: [base] key {key!r} is not allowed in a spec (the runner sets out and resume "
                            "per cell; the spec replaces a --config file); remove it")
    check_keys("[base]", base, train_keys, src)
    return base


def _check_grid(raw: dict[str, Any], base: dict[str, Any], train_keys: set[str], src: Path) -> dict[str, Any]:
    """The ``[grid]`` table: at least one axis, each a non-empty list of plain values or of bundles,
    no value twice, and no key set both there and in ``[base]`` (or by two axes)."""
    if "grid" not in raw:
        raise SpecError(f"{src}: no [grid] table; add at least one axis, e.g. [grid] seed = [0]")
    grid = raw["grid"]
    expect(grid, dict, "[grid]", src, "a table of axes (lists)")
    if not grid:
        raise SpecError(f"{src}: [grid] is empty; add at least one axis, e.g. seed = [0]")
    provided: dict[str, str] = {k: "[base]" for k in base}  # train key -> where it is set
    for key, values in grid.items():
        if key in NOT_IN_SPECS:
            raise SpecError(f"{src}: [grid] axis {key!r} is not allowed in a spec (the runner sets out and resume "
                            "per cell); remove it")
        expect(values, list, f"[grid] axis {key!r}", src, "a list of values, e.g. [1, 2]")
        if not values:
            raise SpecError(f"{src}: [grid] axis {key!r} is an empty list; give at least one value")
        if any(isinstance(v, dict) for v in values):
            keys = _check_bundles(key, values, train_keys, src)
        else:
            check_keys("[grid]", {key: values}, train_keys, src)
            for v in values:
                expect(v, (str, int, float, bool), f"[grid] {key!r} value", src, "a string, number or boolean")
            keys = {key}
        texts = [_axis_text(key, v) for v in values]
        dup = next((t for t in texts if texts.count(t) > 1), None)
        if dup is not None:
            raise SpecError(f"{src}: [grid] axis {key!r} lists {dup!r} twice")
        for k in sorted(keys):
            if k in provided:
                raise SpecError(f"{src}: {k!r} is set in both {provided[k]} and [grid] axis {key!r}; keep it in one")
            provided[k] = f"[grid] axis {key!r}"
    return grid


def expand(spec: Spec) -> list[Cell]:
    """The cartesian product of the grid axes, in axis order; each cell validated.

    A cell's ``params`` are the train keys its grid values set (an axis of tables contributes the
    keys of its table), so plots and tables see e.g. ``compressor`` and ``accumulation``.
    """
    axes = list(spec.grid)
    defaults = TrainConfig()
    cells: list[Cell] = []
    seen: dict[str, Any] = {}
    for values in itertools.product(*(spec.grid[a] for a in axes)):
        params: dict[str, Any] = {}
        for axis, v in zip(axes, values):
            params.update({k: x for k, x in v.items() if k != "label"} if isinstance(v, dict) else {axis: v})
        config = trace_for_spec({**spec.base, **params}, spec.path)
        # -- netem hook: a real-backend cell with a bandwidth runs in the network testbed --
        config = netem_for_cell(config)
        name = cell_name_from(axes, values)
        if name in seen:
            raise SpecError(f"{spec.path}: cells {seen[name]} and {params} get the same directory name {name!r}")
        seen[name] = params
        validate_config(config, spec.path, f"cell {name}")
        if spec.repeats == 1:
            cells.append(Cell(params, config, name))
            continue
        base_seed = int(config.get("seed", defaults.seed))
        chosen = spec.repeats_where is None or matches_where(lambda k, c=config: c.get(k, getattr(defaults, k)),
                                                             spec.repeats_where)
        for i in range(spec.repeats if chosen else 1):
            seed = base_seed + i
            cells.append(Cell({**params, "seed": seed}, {**config, "seed": seed}, f"{name}__seed={seed}"))
    # every configuration's first seed before any second one: an interrupted sweep has them all once
    return sorted(cells, key=lambda c: c.config.get("seed", defaults.seed)) if spec.repeats > 1 else cells
