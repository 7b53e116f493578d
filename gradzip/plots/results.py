"""Reading run directories and computing the per-run numbers of the results table.

A *run directory* is what ``gradzip train --out DIR`` writes: ``config.toml``, ``metrics.jsonl``
(one JSON object per optimizer step) and, once finished, ``summary.json``. A *sweep directory* is
what ``gradzip sweep`` writes: ``sweep.json`` plus one run directory per cell. :func:`load_runs`
accepts either (or any directory whose sub-directories are runs).

Every number in ``results.md``/``results.csv`` is computed here, from ``summary.json`` where it has
the number and from ``metrics.jsonl`` otherwise, so figures and tables agree.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradzip.errors import GradzipError
from gradzip.host import is_contended
from gradzip.io import read_jsonl
from gradzip.units import parse_bandwidth

# Figure name -> what it shows (drawn by gradzip.plots.figures; here so that listing them is cheap).
FIGURES: dict[str, str] = {
    "loss_steps": "training loss against optimizer steps",
    "loss_time": "training loss against wall-clock time",
    "throughput_bandwidth": "throughput (samples/s) against link bandwidth, per compressor",
    "bytes_per_step": "bytes sent per rank per step, per compressor (log scale)",
    "step_time": "time of a step split into compute, compression and exposed communication",
    "schedule": "one step's timeline: backward, encodes, waits and decodes on the compute thread; rounds on the link",
    "loss_vs_ratio": "final eval loss against compression ratio (accuracy–bandwidth trade-off)",
    "scaling": "scaling efficiency against number of workers",
    "bytes_workers": "bytes sent per rank per step against workers, per method (log-log)",
    "throughput_workers": "throughput (samples/s) against workers, per method",
    "loss_vs_bytes": "final held-out MLM loss against total bytes sent per worker, per configuration (log x)",
    "time_to_target": "modelled time to the target loss at the [target] bandwidths, per configuration",
    "policy": "--compressor auto: the share of elements per candidate over the run, on the measured link rate",
    "downstream_vs_bytes": "fine-tuned accuracy against bytes sent per worker in pretraining ([downstream] sweeps)",
    "delta_ci": "paired Δ final eval loss vs none per configuration, with its 95% t interval (seed groups)",
}

# metrics.jsonl fields that a figure can put on its y axis, as ``<field>_steps`` (against optimizer
# steps) or ``<field>_time`` (against the run's clock), with their axis labels.
METRICS: dict[str, str] = {
    "loss": "MLM + NSP loss (nats)", "mlm_loss": "masked-LM loss (nats)", "nsp_loss": "next-sentence loss (nats)",
    "lr": "learning rate", "tokens": "tokens processed (count)", "samples": "samples processed (count)",
    "step_s": "step time (s)", "wall_s": "cumulative time (s)", "compute_s": "compute time per step (s)",
    "compress_s": "compression time per step (s)", "comm_s": "exposed communication per step (s)",
    "opt_s": "optimizer time per step (s)", "bytes_sent": "bytes sent per rank per step",
    "bytes_recv": "bytes received per rank per step", "bytes_inter": "bytes sent between nodes per step",
    "grad_norm": "gradient norm (before clipping)", "host_s": "host seconds since start",
    "eval_loss": "held-out MLM + NSP loss (nats)", "eval_mlm_loss": "held-out masked-LM loss (nats)",
    "eval_nsp_loss": "held-out next-sentence loss (nats)", "eval_mlm_acc": "masked-token accuracy (top-1)",
    "eval_nsp_acc": "next-sentence accuracy",
    "eval_excess_loss": "held-out masked-LM loss above the optimum (nats)",
}
# Drawn by default besides FIGURES, when the runs have the metric.
DEFAULT_METRIC_FIGURES = ("eval_mlm_loss_steps", "eval_mlm_acc_steps")


def metric_figure(name: str) -> tuple[str, str] | None:
    """``eval_mlm_acc_steps`` -> ("eval_mlm_acc", "steps"); ``_time`` and ``_bytes`` (cumulative bytes
    sent per worker) too; None if ``name`` is not a metric figure."""
    for x in ("steps", "time", "bytes"):
        metric = name.removesuffix("_" + x)
        if metric != name and metric in METRICS:
            return metric, x
    return None


def is_figure(name: str) -> bool:
    return name in FIGURES or metric_figure(name) is not None


FIGURE_CHOICES = ", ".join(FIGURES) + ", or METRIC_steps / METRIC_time / METRIC_bytes for a metrics.jsonl field METRIC"


def _mean_of(runs: list[Run], key: str) -> float | None:
    vals = [float(r.summary[key]) for r in runs if (r.summary or {}).get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def reference(runs: list[Run], metric: str) -> list[tuple[float, str]]:
    """The context-free reference levels of ``metric`` from the runs' summaries, with legend labels
    (``gradzip train`` reports them; see :class:`gradzip.data.pretrain.UnigramReference`): the
    unigram entropy H and the context-free floor (H minus what copying the visible input token of
    BERT's unchanged and random masked positions is worth); [] when unknown."""
    h, floor = _mean_of(runs, "unigram_entropy"), _mean_of(runs, "context_free_mlm_loss")
    top, floor_acc = _mean_of(runs, "top_token_rate"), _mean_of(runs, "context_free_mlm_acc")
    opt = _mean_of(runs, "optimal_mlm_loss")  # a generated language's exact optimum
    out: list[tuple[float, str]] = []
    if metric == "eval_mlm_loss" and opt is not None:
        out.append((opt, f"Bayes-optimal loss {opt:.2f}"))
    if metric == "eval_excess_loss" and opt is not None and h is not None:
        return [(0.0, "the optimum"), (h - opt, f"unigram entropy H = optimum + {h - opt:.2f}")]
    if metric in ("mlm_loss", "eval_mlm_loss"):
        out += [(h, f"unigram entropy H = {h:.2f} (no context)")] if h is not None else []
        if floor and floor != h:  # [MASK]-only masking (a generated language): the floor is H
            out.append((floor, f"context-free floor {floor:.2f} (H, less copying the input token)"))
    elif metric in ("loss", "eval_loss"):
        out += [(h + math.log(2), f"unigram plateau H + ln 2 = {h + math.log(2):.2f}")] if h is not None else []
        out += [(floor + math.log(2), f"context-free floor + ln 2 = {floor + math.log(2):.2f}")] if floor else []
    elif metric == "eval_mlm_acc":
        out += [(top, f"most frequent token {top:.3f}")] if top is not None else []
        out += [(floor_acc, f"context-free floor {floor_acc:.3f}")] if floor_acc else []
    elif metric == "eval_nsp_acc":
        out.append((0.5, "chance 0.5"))
    return out


# Config keys that never distinguish runs (paths, resume flags, logging cadence).
IGNORED_KEYS = {"out", "resume", "checkpoint_every", "eval_every", "eval_batches", "keep_checkpoints", "progress",
                "config", "stop_at", "timeout", "log", "threads"}  # threads: the host's, not the experiment's
# Keys that do not change the bytes on the wire (for the bytes-per-step figure).
NOT_BYTES_KEYS = {"bandwidth", "latency", "seed", "lr", "warmup", "clip"}


@dataclass
class LossTarget:
    """The loss (or other ``metric``) a run must reach for its time to target: the ``[target]`` of a
    spec or ``gradzip plot --target``. The same fields as :class:`gradzip.experiments.spec.Target`
    (repeated here to keep plots free of experiments).

    ``bandwidths`` (texts such as ``"100mbit"``, or bits/s) add the modelled time to the target at
    each of them (:mod:`gradzip.plots.retime`)."""

    loss: float
    metric: str = "loss"
    smoothing: float = 0.9
    bandwidths: list[Any] = field(default_factory=list)


@dataclass
class Run:
    dir: Path
    name: str
    config: dict[str, Any]
    summary: dict[str, Any] | None
    metrics: list[dict[str, Any]]
    params: dict[str, Any] = field(default_factory=dict)  # grid values when from a sweep

    # -- identity ---------------------------------------------------------------------------
    @property
    def compressor(self) -> str:
        return str(self.params.get("compressor", self.config.get("compressor", (self.summary or {}).get(
            "compressor", "none"))))

    @property
    def compressor_family(self) -> str:
        return self.compressor.split(":", 1)[0].strip().lower()

    def value(self, key: str) -> Any:
        """A parameter as the user wrote it (grid text) if known, else the resolved config value."""
        if key in self.params:
            return self.params[key]
        if key == "compressor":
            return self.compressor
        if key in self.config:
            return self.config[key]
        return (self.summary or {}).get(key)

    @property
    def clock(self) -> str:
        for m in self.metrics:
            if m.get("clock"):
                return str(m["clock"])
        return str((self.summary or {}).get("clock", "measured"))

    @property
    def contended(self) -> bool:
        """Over 5% of the run's steps shared their cores with other processes (``contended_steps``)."""
        s = self.summary or {}
        return is_contended(int(s.get("contended_steps") or 0), int(s.get("steps") or 0))

    @property
    def workers(self) -> int:
        return int((self.summary or {}).get("workers") or self.config.get("workers") or 1)

    @property
    def bandwidth_bps(self) -> float | None:
        """The link's bits/s; None when not known, or for an ``unshaped`` testbed link (no rate)."""
        bw = self.value("bandwidth")
        return None if bw is None or str(bw).strip().lower() == "unshaped" else parse_bandwidth(bw)

    # -- per-step series -----------------------------------------------------------------------
    @property
    def train_rows(self) -> list[dict[str, Any]]:
        return [m for m in self.metrics if m.get("loss") is not None and m.get("step") is not None]

    def times(self) -> list[float]:
        """Cumulative clock time (s) at the end of each row of ``train_rows`` (``wall_s``)."""
        return [float(m.get("wall_s", 0.0)) for m in self.train_rows]

    def eval_points(self) -> tuple[list[int], list[float], list[float]]:
        """(steps, times, eval losses) of the evaluation rows."""
        steps, times, losses = [], [], []
        for m in self.metrics:
            if m.get("eval_loss") is not None:
                steps.append(int(m["step"]))
                times.append(float(m.get("wall_s", 0.0)))
                losses.append(float(m["eval_loss"]))
        return steps, times, losses

    def phase_means(self) -> dict[str, float]:
        """Mean seconds per step in compute, compression, exposed communication and the optimizer.

        The first step is left out when there are several (it pays one-off warm-up costs).
        """
        rows = self.train_rows
        rows = rows[1:] if len(rows) > 1 else rows
        keys = {"compute": "compute_s", "compress": "compress_s", "comm": "comm_s", "opt": "opt_s"}
        if not rows:
            return dict.fromkeys(keys, 0.0)
        return {k: sum(float(m.get(f) or 0.0) for m in rows) / len(rows) for k, f in keys.items()}

    # -- summary numbers ------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        if self.summary and self.summary.get("steps") is not None:
            return int(self.summary["steps"])
        rows = self.train_rows
        return int(rows[-1]["step"]) if rows else 0

    @property
    def final_eval_loss(self) -> float | None:
        v = (self.summary or {}).get("final_eval_loss")
        if v is None:
            _, _, losses = self.eval_points()
            v = losses[-1] if losses else None
        return None if v is None else float(v)

    @property
    def final_eval_mlm_loss(self) -> float | None:
        """The masked-LM part of the last eval (from the metrics when the summary predates it)."""
        v = (self.summary or {}).get("final_eval_mlm_loss")
        if v is None:
            v = next((m["eval_mlm_loss"] for m in reversed(self.metrics) if m.get("eval_mlm_loss") is not None), None)
        return None if v is None else float(v)

    @property
    def final_loss(self) -> float | None:
        v = (self.summary or {}).get("final_loss")
        if v is None and self.train_rows:
            v = self.train_rows[-1]["loss"]
        return None if v is None else float(v)

    @property
    def bytes_per_step(self) -> float | None:
        v = (self.summary or {}).get("bytes_per_step")
        if v is None:
            rows = self.train_rows
            v = sum(float(m.get("bytes_sent", 0)) for m in rows) / len(rows) if rows else None
        return None if v is None else float(v)

    @property
    def mb_per_step(self) -> float | None:
        b = self.bytes_per_step
        return None if b is None else b / 1e6

    @property
    def compression_ratio(self) -> float | None:
        v = (self.summary or {}).get("compression_ratio")
        return None if v is None else float(v)

    @property
    def samples_per_s(self) -> float | None:
        """Global training samples per second on the run's clock (all workers together), in steady
        state: from the cumulative ``samples`` and ``wall_s`` of the metrics, first step left out
        (one-off warm-up) when there are at least three steps."""
        rows = self.train_rows
        if not rows:
            s = self.summary or {}
            return float(s["samples"]) / float(s["wall_s"]) if s.get("samples") and s.get("wall_s") else None

        def samples(m: dict[str, Any], i: int) -> float:
            if m.get("samples") is not None:
                return float(m["samples"])
            per_step = int(self.config.get("batch_size", 1)) * int(self.config.get("accumulation", 1)) * self.workers
            return float(per_step * (i + 1))

        times = self.times()
        first = 1 if len(rows) >= 3 else 0
        s0, t0 = (samples(rows[first - 1], first - 1), times[first - 1]) if first else (0.0, 0.0)
        dt = times[-1] - t0
        return (samples(rows[-1], len(rows) - 1) - s0) / dt if dt > 0 else None

    @property
    def bytes_total(self) -> float | None:
        """Bytes one worker sent over the whole run (``summary.json``'s ``bytes_total``; None for
        runs from before it was written)."""
        v = (self.summary or {}).get("bytes_total")
        return None if v is None else float(v)

    def target_index(self, target: LossTarget) -> int | None:
        """Index in ``metrics`` of the row where the target metric first reaches ``target.loss``
        (None: never): the first eval at or below it (``metric="eval_loss"``), or the first step
        whose bias-corrected EMA of the training loss (decay ``smoothing``) is at or below it."""
        if target.metric == "eval_loss":
            return next((i for i, m in enumerate(self.metrics) if m.get("eval_loss") is not None
                         and m.get("step") is not None and float(m["eval_loss"]) <= target.loss), None)
        idx = [i for i, m in enumerate(self.metrics) if m.get("loss") is not None and m.get("step") is not None]
        smoothed = ema([float(self.metrics[i]["loss"]) for i in idx], target.smoothing)
        return next((i for i, s in zip(idx, smoothed) if s <= target.loss), None)

    def time_to_target(self, target: LossTarget | None) -> tuple[int, float] | None:
        """(step, cumulative seconds) where the target metric first reaches ``target.loss``."""
        if target is None:
            return None
        i = self.target_index(target)
        if i is None:
            return None
        return int(self.metrics[i]["step"]), float(self.metrics[i].get("wall_s", 0.0))

def ema(values: list[float], decay: float = 0.9) -> list[float]:
    """Exponential moving average with bias correction (so the first points are not pulled to 0)."""
    out, acc = [], 0.0
    for i, v in enumerate(values, 1):
        acc = decay * acc + (1 - decay) * v
        out.append(acc / (1 - decay**i) if decay > 0 else v)
    return out


def centred_mean(values: list[float], half: int) -> list[float]:
    """Moving average over ``2*half + 1`` points centred on each point (shorter at the ends): smooths
    without the lag of a causal average, so a smoothed curve stays over the steps it summarises."""
    if half <= 0 or not values:
        return list(values)
    csum = [0.0]
    for v in values:
        csum.append(csum[-1] + v)
    n = len(values)
    return [(csum[min(n, i + half + 1)] - csum[max(0, i - half)]) / (min(n, i + half + 1) - max(0, i - half))
            for i in range(n)]


# -- loading ----------------------------------------------------------------------------------

def _read_metrics(path: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(path) if isinstance(r, dict)]


def is_run_dir(path: Path) -> bool:
    return (path / "metrics.jsonl").is_file() or (path / "summary.json").is_file()


def load_run(path: Path, params: dict[str, Any] | None = None, name: str | None = None) -> Run:
    config: dict[str, Any] = {}
    summary = None
    try:
        if (path / "config.toml").is_file():
            with open(path / "config.toml", "rb") as f:
                config = tomllib.load(f)
        if (path / "summary.json").is_file():
            summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))
            if not isinstance(summary, dict):
                raise GradzipError(f"{path / 'summary.json'} holds a JSON {type(summary).__name__}, not the object "
                                   "gradzip writes; move it away or re-run the cell")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise GradzipError(f"{path}: cannot read its config.toml/summary.json ({type(e).__name__}: "
                           f"{str(e).splitlines()[0]}); repair or remove that run directory") from None
    return Run(path, name or path.name, config, summary, _read_metrics(path / "metrics.jsonl"), dict(params or {}))


@dataclass
class Collection:
    """The runs found under a directory, plus what the sweep's spec says about them."""

    root: Path
    runs: list[Run]
    sweep: dict[str, Any] | None = None

    @property
    def spec(self) -> dict[str, Any]:
        return (self.sweep or {}).get("spec") or {}

    @property
    def target(self) -> LossTarget | None:
        t = self.spec.get("target")
        return LossTarget(**t) if t else None

    def varying(self) -> list[str]:
        """Parameters whose value differs between runs, grid axes first (in grid order)."""
        keys: list[str] = list((self.spec.get("grid") or {}).keys())
        for r in self.runs:
            for k in r.config:
                if k not in keys:
                    keys.append(k)
        out = []
        for k in keys:
            if k in IGNORED_KEYS:
                continue
            values = {_hashable(r.value(k)) for r in self.runs}
            if len(values) > 1:
                out.append(k)
        return out

    def fixed(self) -> dict[str, Any]:
        """Parameters equal in every run (for captions)."""
        if not self.runs:
            return {}
        vary = set(self.varying())
        first = self.runs[0]
        return {k: first.value(k) for k in first.config if k not in vary and k not in IGNORED_KEYS}

    def select(self, where: dict[str, Any] | None) -> Collection:
        """The runs that match ``where`` (see :func:`matches_where`); all of them for None or {}."""
        if not where:
            return self
        return Collection(self.root, [r for r in self.runs if matches_where(r.value, where)], self.sweep)


def _hashable(v: Any) -> Any:
    return json.dumps(v, sort_keys=True, default=str)


# -- restricting a figure to some runs (a spec's [plot.where]) ------------------------------------

def where_text(v: Any) -> str:
    """A value as compared by :func:`matches_where`: booleans ``true``/``false``, numbers by value
    (``8`` equals ``8.0``, ``1e-3`` equals ``0.001``), anything else as its text."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else repr(v)
    return str(v).strip()


def matches_where(value_of: Callable[[str], Any], where: dict[str, Any]) -> bool:
    """Whether a run passes ``where`` = {key: value or list of values}: for every key, the run's
    value (``value_of(key)``: the grid text if the key is a grid value, else the resolved config)
    equals the value, or one of the list's, compared by :func:`where_text`."""
    for key, wanted in where.items():
        allowed = {where_text(w) for w in (wanted if isinstance(wanted, list) else [wanted])}
        if where_text(value_of(key)) not in allowed:
            return False
    return True


def describe_where(where: dict[str, Any]) -> str:
    """``workers=8 and compressor in {onebit, onebit:exchange=twophase}`` (for captions)."""
    parts = []
    for key, wanted in where.items():
        if isinstance(wanted, list) and len(wanted) != 1:
            parts.append(f"{key} in {{{', '.join(where_text(w) for w in wanted)}}}")
        else:
            parts.append(f"{key}={where_text(wanted[0] if isinstance(wanted, list) else wanted)}")
    return " and ".join(parts)


def load_runs(path: str | Path) -> Collection:
    """Runs of a run directory, a sweep directory, or a directory of run directories."""
    root = Path(path)
    if not root.is_dir():
        raise GradzipError(f"{str(root)!r} is not a directory (give a run or sweep directory)")
    if is_run_dir(root):
        return Collection(root, [load_run(root)])
    sweep = None
    runs: list[Run] = []
    if (root / "sweep.json").is_file():
        try:
            sweep = json.loads((root / "sweep.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise GradzipError(f"{root / 'sweep.json'} is not valid JSON ({e}); re-run the sweep") from None
        for cell in sweep.get("cells", []):
            d = root / cell["name"]
            if is_run_dir(d) and cell.get("status") != "failed":
                runs.append(load_run(d, cell.get("params"), cell["name"]))
    else:
        for d in sorted(p for p in root.iterdir() if p.is_dir()):
            if is_run_dir(d):
                runs.append(load_run(d))
    runs = [r for r in runs if r.train_rows or r.summary]
    if not runs:
        raise GradzipError(f"no finished runs found in {str(root)!r} (a run directory holds metrics.jsonl; "
                           "a sweep directory holds sweep.json)")
    return Collection(root, runs, sweep)
