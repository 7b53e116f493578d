"""The results table (``results.md``/``results.csv``): one row per run, or per seed group when some
runs differ only by seed (:mod:`gradzip.plots.seeds`). Every number comes from
:mod:`gradzip.plots.results`, so figures and tables agree."""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from typing import Any

from gradzip.plots.paired import NOTE as PAIRED_NOTE
from gradzip.plots.paired import Paired, interval_text, paired_diffs, per_seed_text, verdict_text
from gradzip.plots.results import Collection, LossTarget, Run, _hashable
from gradzip.plots.retime import bandwidth_columns, time_to_target_at
from gradzip.plots.seeds import Stat, exceeds_spread, spread_of, stat
from gradzip.units import format_bandwidth

# -- the results table ---------------------------------------------------------------------------

def baseline_of(run: Run, runs: list[Run], vary: list[str]) -> Run | None:
    """The ``none`` run whose other varying parameters equal ``run``'s."""
    others = [k for k in vary if k != "compressor"]
    for b in runs:
        if b.compressor_family == "none" and all(_hashable(b.value(k)) == _hashable(run.value(k)) for k in others):
            return b
    return None


def _fmt(v: float | None, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if v != 0 and abs(v) < 1e-3:
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits}g}"


def run_groups(col: Collection) -> list[list[Run]]:
    """Runs that differ only by ``seed``, grouped (in the runs' order); see :mod:`gradzip.plots.seeds`."""
    vary = [k for k in col.varying() if k not in ("seed", "compressor")]
    groups: dict[tuple, list[Run]] = {}
    for r in col.runs:
        groups.setdefault((r.compressor, *(_hashable(r.value(k)) for k in vary)), []).append(r)
    return list(groups.values())


def baseline_group(g: list[Run], groups: list[list[Run]], others: list[str]) -> int | None:
    """Index in ``groups`` of the ``none`` group whose ``others`` parameters equal ``g``'s."""
    return next((i for i, b in enumerate(groups) if b[0].compressor_family == "none"
                 and all(_hashable(b[0].value(k)) == _hashable(g[0].value(k)) for k in others)), None)


def paired_vs_none(col: Collection) -> list[tuple[list[Run], Paired | None]]:
    """Each seed group with its paired Δ vs none (:mod:`gradzip.plots.paired`); None for ``none``
    groups and groups without a ``none`` group of otherwise equal parameters."""
    groups = run_groups(col)
    others = [k for k in col.varying() if k not in ("seed", "compressor")]
    out: list[tuple[list[Run], Paired | None]] = []
    for g in groups:
        bi = baseline_group(g, groups, others)
        out.append((g, None if bi is None or g[0].compressor_family == "none" else paired_diffs(g, groups[bi])))
    return out


@dataclass
class Delta:
    """Δ vs none of a seed group: difference of means, and whether it exceeds the seed spread."""

    value: float | None
    exceeds: bool | None
    spread: float | None


def _run_numbers(r: Run, target: LossTarget | None, accs: list[str]) -> dict[str, Any]:
    d: dict[str, Any] = {"final_eval_loss": r.final_eval_loss, "final_eval_mlm_loss": r.final_eval_mlm_loss}
    d.update({k: (r.summary or {}).get(k) for k in accs if k != "final_eval_mlm_loss"})
    if target:
        hit = r.time_to_target(target)
        d.update(steps_to_target=hit[0] if hit else None, time_to_target_s=hit[1] if hit else None)
        for name, bps in bandwidth_columns(target.bandwidths):
            d[name] = time_to_target_at(r, target, bps) if hit else None
    d.update(mb_per_step=r.mb_per_step, compression_ratio=r.compression_ratio, samples_per_s=r.samples_per_s)
    return d


def results_rows(col: Collection, target: LossTarget | None = None) -> tuple[list[str], list[list[Any]]]:
    """Header and rows of the results table: one row per run, or, when some runs differ only by
    seed, one row per seed group whose numbers are :class:`~gradzip.plots.seeds.Stat` and whose
    Δ vs none is a :class:`Delta`."""
    target = target or col.target
    groups = run_groups(col)
    seeded = any(len(g) > 1 for g in groups)
    vary = [k for k in col.varying() if k != "compressor" and not (seeded and k == "seed")]
    # Accuracies where the runs report them (runs made before they existed have none).
    accs = [k for k in ("final_eval_mlm_acc", "final_eval_nsp_acc")
            if any((r.summary or {}).get(k) is not None for r in col.runs)]
    if accs:  # runs that report accuracies report the masked-LM part of the loss too
        accs.insert(0, "final_eval_mlm_loss")
    if any((r.summary or {}).get("final_eval_excess_loss") is not None for r in col.runs):
        accs.insert(1 if accs else 0, "final_eval_excess_loss")  # generated languages: next to MLM loss
    paired = ["delta_per_seed", "delta_paired", "verdict"] if seeded else []
    numbers = ["final_eval_loss", "delta_vs_none", *paired, *accs]
    if target:
        numbers += ["steps_to_target", "time_to_target_s", *(name for name, _ in bandwidth_columns(target.bandwidths))]
    numbers += ["clock", "mb_per_step", "compression_ratio", "samples_per_s"]
    if not seeded:
        rows = []
        all_vary = col.varying()
        for r in col.runs:
            base = baseline_of(r, col.runs, all_vary)
            d = _run_numbers(r, target, accs)
            if base is not None and r.final_eval_loss is not None and base.final_eval_loss is not None:
                d["delta_vs_none"] = r.final_eval_loss - base.final_eval_loss
            d["clock"] = r.clock + (" (contended)" if r.contended else "")
            rows.append([r.name, r.compressor, *(r.value(k) for k in vary), *(d.get(k) for k in numbers)])
        return ["run", "compressor", *vary, *numbers], rows
    stats = []
    for g in groups:
        per_run = [_run_numbers(r, target, accs) for r in g]
        stats.append({k: stat([d[k] for d in per_run]) for k in per_run[0]})
    rows = []
    others = [k for k in col.varying() if k not in ("seed", "compressor")]
    for (g, p), st in zip(paired_vs_none(col), stats):
        first = g[0]
        bi = baseline_group(g, groups, others)
        base = None if bi is None else stats[bi]
        d: dict[str, Any] = dict(st)
        # The paired columns hold the Paired itself (each column shows its part); "baseline" for none.
        d.update(delta_per_seed=p, delta_paired=p, verdict=p)
        if bi is not None and first.compressor_family == "none":
            d["verdict"] = "baseline"
        a, b = st["final_eval_loss"], base["final_eval_loss"] if base else None
        d["delta_vs_none"] = (Delta(a.mean - b.mean, exceeds_spread(a, b), spread_of(a, b))
                              if b is not None and a.mean is not None and b.mean is not None else None)
        d["clock"] = first.clock + (" (contended)" if any(r.contended for r in g) else "")
        rows.append([first.compressor, *(first.value(k) for k in vary), len(g), *(d.get(k) for k in numbers)])
    return ["compressor", *vary, "seeds", *numbers], rows


_TITLES = {
    "run": "run", "compressor": "compressor", "final_eval_loss": "final eval loss",
    "delta_vs_none": "Δ vs none", "final_eval_mlm_loss": "MLM loss", "final_eval_mlm_acc": "MLM acc",
    "final_eval_nsp_acc": "NSP acc", "final_eval_excess_loss": "excess loss",
    "delta_per_seed": "Δ per seed", "delta_paired": "Δ mean [95% CI]", "verdict": "verdict",
    "steps_to_target": "steps to target", "time_to_target_s": "time to target (s)",
    "clock": "clock", "mb_per_step": "MB/step", "seeds": "seeds", "compression_ratio": "compression ×",
    "samples_per_s": "samples/s",
}


_RIGHT = {"delta_vs_none", "delta_per_seed", "delta_paired"}  # numbers in text cells, right-aligned
# The paired columns' CSV fields (the per-seed differences are in results.md only).
PAIRED_CSV = {"delta_per_seed": [], "delta_paired": ["delta_paired_mean", "delta_paired_lo", "delta_paired_hi",
                                                     "delta_paired_n"], "verdict": ["verdict"]}


def _title(h: str) -> str:
    """A column's heading: ``time_to_target_100mbit_s`` -> ``time to target @ 100mbit (s)``."""
    if h.startswith("time_to_target_") and h.endswith("_s") and h != "time_to_target_s":
        return f"time to target @ {h.removeprefix('time_to_target_').removesuffix('_s')} (s)"
    return _TITLES.get(h, h)


def _cell(h: str, v: Any, compressor: str) -> str:
    if h == "delta_vs_none" and compressor.split(":")[0].strip() == "none":
        return "baseline"
    if v is None:
        return "—"
    if isinstance(v, Paired):
        return {"delta_per_seed": per_seed_text, "delta_paired": interval_text}.get(h, verdict_text)(v)
    if isinstance(v, Delta):
        if v.value is None:
            return "—"
        text = f"{v.value if abs(v.value) >= 5e-5 else 0.0:+.4f}"
        if v.exceeds is None:
            return text + " (1 seed)"
        return text + (f" (> spread {v.spread:.4f})" if v.exceeds else f" (within spread {v.spread:.4f})")
    if h == "delta_vs_none":
        return f"{v if abs(v) >= 5e-5 else 0.0:+.4f}"  # no "-0.0000"
    if h == "compressor":
        return f"`{v}`"
    digits = 3 if h == "compression_ratio" else 4
    unit = "×" if h == "compression_ratio" else ""
    if isinstance(v, Stat):
        return v.text(lambda x: _fmt(x, digits)) + (unit if v.values else "")
    if isinstance(v, float):
        return _fmt(v, digits) + unit
    return str(v)


def results_markdown(col: Collection, target: LossTarget | None = None) -> str:
    target = target or col.target
    header, rows = results_rows(col, target)
    show_run = "run" in header and len({r.name for r in col.runs}) > 1
    idx = [i for i, h in enumerate(header) if h != "run" or show_run]

    def numeric(i: int) -> bool:
        vals = [row[i] for row in rows if row[i] is not None]
        return bool(vals) and all(isinstance(v, (int, float, Stat, Delta)) and not isinstance(v, bool) for v in vals)

    lines = ["| " + " | ".join(_title(header[i]) for i in idx) + " |",
             "|" + "|".join("---:" if numeric(i) or header[i] in _RIGHT else "---" for i in idx) + "|"]
    ci = header.index("compressor")
    for row in rows:
        lines.append("| " + " | ".join(_cell(header[i], row[i], str(row[ci])) for i in idx) + " |")
    seeded = "seeds" in header
    what = f"{len(rows)} configuration(s), {len(col.runs)} runs" if seeded else f"{len(rows)} run(s)"
    notes = ["", f"{what}. Δ vs none: final eval loss minus that of the `none` run with otherwise "
             "equal parameters. MB/step: megabytes (10^6 B) sent per rank per optimizer step. "
             "compression ×: fp32 bytes / bytes sent. samples/s: global samples per second on the run's clock, "
             "first step (warm-up) excluded."]
    if any(r.contended for r in col.runs):
        notes.append("(contended): some of that row's steps shared their cores with other processes (summary.json's "
                     "contended_steps); its measured times, and so its samples/s, may be inflated. sim's modelled "
                     "times count one-thread CPU time and hold up best.")
    if seeded:
        notes.append("Runs that differ only by seed are one row: the mean, with the min–max range for 2–3 seeds or "
                     "± the standard deviation for 4 or more; Δ vs none is the difference of the means, marked "
                     "> spread when it is larger than the wider min–max range of the two rows' seeds.")
        notes.append(PAIRED_NOTE)
    if "final_eval_excess_loss" in header:
        notes.append("excess loss: the held-out masked-LM loss above the exact optimum of the generated language "
                     "the runs trained on (summary.json's final_eval_excess_loss; 0 is a perfect model).")
    if target:
        what = "eval loss" if target.metric == "eval_loss" else f"training loss (EMA {target.smoothing:g})"
        notes.append(f"Target: {what} ≤ {target.loss:g}; time is cumulative on each run's clock (— = not reached).")
        if target.bandwidths:
            at = ", ".join(format_bandwidth(bps) for _, bps in bandwidth_columns(target.bandwidths))
            notes.append(f"time to target @ B ({at}): modelled, the run re-timed step by step as if its link had "
                         "bandwidth B (each step's exposed communication changes by the link time of its bytes at B "
                         "instead of the run's bandwidth, never below 0; see gradzip.plots.retime).")
    return "\n".join(lines + notes) + "\n"


def results_csv(col: Collection, target: LossTarget | None = None) -> str:
    """The table as CSV: a seed group's number ``x`` becomes ``x`` (the mean), ``x_std``, ``x_min``,
    ``x_max``; its Δ vs none adds ``delta_exceeds_spread``; its paired Δ vs none is
    ``delta_paired_mean``, ``_lo``, ``_hi`` (the 95% t interval), ``_n`` (seeds paired) and
    ``verdict`` (worse, better, within noise, baseline; empty under 2 paired seeds)."""
    header, rows = results_rows(col, target)
    out_header: list[str] = []
    for i, h in enumerate(header):
        if h in PAIRED_CSV:
            out_header += PAIRED_CSV[h]
            continue
        out_header.append(h)
        if any(isinstance(row[i], Stat) for row in rows):
            out_header += [f"{h}_std", f"{h}_min", f"{h}_max"]
        if any(isinstance(row[i], Delta) for row in rows):
            out_header += ["delta_exceeds_spread"]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(out_header)

    def text(v: Any) -> Any:
        return "" if v is None else (repr(v) if isinstance(v, float) else v)

    for row in rows:
        cells: list[Any] = []
        for i, v in enumerate(row):
            if header[i] == "delta_paired":
                p = v if isinstance(v, Paired) else None
                cells += [text(p.mean), text(p.lo), text(p.hi), p.n] if p else ["", "", "", ""]
            elif header[i] == "verdict":
                cells.append(v.verdict if isinstance(v, Paired) and v.n >= 2 else v if isinstance(v, str) else "")
            elif header[i] in PAIRED_CSV:
                continue  # the per-seed differences: in results.md only
            elif any(isinstance(r[i], Stat) for r in rows):
                v = v if isinstance(v, Stat) else stat([])
                cells += [text(v.mean), text(v.std), text(v.lo), text(v.hi)]
            elif any(isinstance(r[i], Delta) for r in rows):
                cells += [text(v.value), text(v.exceeds)] if isinstance(v, Delta) else ["", ""]
            else:
                cells.append(text(v))
        w.writerow(cells)
    return buf.getvalue()
