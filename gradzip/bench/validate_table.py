"""The markdown table of ``python -m gradzip.bench.validate`` (:mod:`gradzip.bench.validate`)."""

from __future__ import annotations

import argparse
import statistics
from typing import Any


def pct(v: float | None, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:+.{digits}%}"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1e3:.0f} ms"


def _mb(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1e6:.3f} MB"


def _columns(rows: list[dict[str, Any]]) -> tuple[bool, bool]:
    """(layout columns: several ranks per host or a hierarchical exchange; sync columns: an outer --sync)."""
    wide = any(r.get("ranks_per_node", 1) > 1 or r.get("mode", "flat") != "flat" for r in rows)
    outer = any(r.get("sync", "step") != "step" for r in rows)
    return wide, outer


def _header(wide: bool, outer: bool) -> list[str]:
    head = "| hosts × ranks | exchange | " if wide else "| hosts | "
    rule = "|---|---|" if wide else "|---|"
    if outer:
        head += "sync | "
        rule += "---|"
    head += ("rate | compressor | measured step | predicted step | error | error, same-run compute | "
             "predicted step, step-calibrated (error) | measured exposed comm | predicted comm | "
             "wire/accounted − 1 (tx_bytes; frames) |")
    rule += "---|---|---|---|---|---|---|---|---|---|"
    if outer:
        head += " sync cost per period: measured, predicted (error) |"
        rule += "---|"
    if wide:
        head += " inter-host bytes/rank/step: engine, predicted, wire |"
        rule += "---|"
    return [head, rule]


def _line(r: dict[str, Any], wide: bool, outer: bool) -> str:
    line = (f"| {r['hosts']} × {r.get('ranks_per_node', 1)} | {r.get('mode', 'flat')} | " if wide
            else f"| {r['hosts']} | ")
    if outer:
        line += f"`{r.get('sync', 'step')}` | "
    line += (f"{r['rate']} | `{r['compressor']}` | {_ms(r['measured_step_s'])} | {_ms(r['predicted_step_s'])} | "
             f"{r['error']:+.1%} | {r['error_same_run_compute']:+.1%} | "
             f"{_ms(r.get('predicted_step_s_step_calibrated'))} ({pct(r.get('error_step_calibrated'), 1)}) | "
             f"{_ms(r['measured_comm_s'])} | {_ms(r['predicted_comm_s'])} | {pct(r['wire_overhead'])}; "
             f"{pct(r['wire_frame_overhead'])} |")
    if outer:
        line += (f" {_ms(r.get('measured_sync_cost_s'))}, {_ms(r.get('predicted_sync_cost_s'))} "
                 f"({pct(r.get('error_sync_cost'), 1)}) |")
    if wide:
        line += (f" {_mb(r.get('inter_bytes_per_step'))}, {_mb(r.get('predicted_inter_bytes'))}, "
                 f"{_mb(r.get('wire_bytes_per_step'))} |")
    return line


def _summary(rows: list[dict[str, Any]], alpha: float, args: argparse.Namespace, total_s: float) -> list[str]:
    def stat(key: str) -> str:
        errs = [abs(r[key]) for r in rows if r.get(key) is not None]
        within = sum(e <= 0.15 for e in errs)
        return (f"median {statistics.median(errs):.1%}, max {max(errs):.1%}, {within} of {len(errs)} within 15%"
                if errs else "n/a")

    return [f"\n{len(rows)} configurations; |error| {stat('error')} (same-run compute: "
            f"{stat('error_same_run_compute')}; step-calibrated: {stat('error_step_calibrated')}); "
            f"alpha {alpha * 1e6:.0f} us; {args.model}, batch {args.batch_size} x {args.seq_len} tokens, "
            f"{args.steps} steps, {args.calibration_steps} for calibration (first {args.warmup} left out; "
            f"outer --sync: means over whole periods, else medians); total {total_s:.0f} s."]


def markdown(rows: list[dict[str, Any]], alpha: float, args: argparse.Namespace, total_s: float) -> str:
    """The table of ``rows``; with several ranks per host or hierarchical runs, also the layout
    (hosts × ranks, exchange) and the inter-host bytes per rank per step (measured by the engine,
    predicted, and on the wire); with an outer ``--sync`` (DiLoCo, LocalSGD), the sync column and
    the sync's cost per period of H steps (H × (mean step − mean compute), measured and predicted)."""
    wide, outer = _columns(rows)
    out = _header(wide, outer) + [_line(r, wide, outer) for r in rows]
    if rows:
        out += _summary(rows, alpha, args, total_s)
    return "\n".join(out) + "\n"
