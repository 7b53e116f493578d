"""Figure ``policy``: what ``--compressor auto`` chose, over the run, on top of the link it measured.

One panel per ``auto`` run (at most :data:`MAX_ROWS`), from its ``policy.jsonl``. Bars: from each
plan to the next (or the run's end), the share of the gradient's elements sent with each candidate,
stacked. Line (right axis, dashed): the link bandwidth each plan's probe measured, a dot per plan.
Under it (solid, pale), when the run directory has a ``link.jsonl`` (``gradzip train --netem-trace``,
or ``gradzip netem reshape --log`` written there from a ``gradzip train`` run): the rate the testbed
was set to, from each change's ``step`` on (rows without a step, or ``unshaped`` ones, are left out).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from gradzip.plots import style
from gradzip.plots.captions import fixed_caption
from gradzip.plots.grouping import Skip, series
from gradzip.plots.results import Collection, LossTarget, Run

MAX_ROWS = 6


def load_policy(run: Run) -> list[dict[str, Any]]:
    """The plans of ``policy.jsonl`` (an unreadable line is skipped), in step order."""
    path = Path(run.dir) / "policy.jsonl"
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("buckets"), list) and isinstance(rec.get("step"), int):
            rows.append(rec)
    return sorted(rows, key=lambda r: r["step"])


def load_link(run: Run) -> list[tuple[int, float]]:
    """``(step, bits/s)`` of each change in ``link.jsonl`` that has a step and a rate, in step order."""
    try:
        lines = (Path(run.dir) / "link.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and isinstance(rec.get("rate_bps"), (int, float)):
            rows.append((rec["step"], float(rec["rate_bps"])))
    return sorted(rows, key=lambda r: r[0])


def _draw_link(twin, link: list[tuple[int, float]], end: int) -> None:
    """The rate the trace set, as a step line from each change to the next (or the run's end)."""
    xs = [st for st, _ in link if st <= end] + [end]
    ys = [bps / 1e9 for st, bps in link if st <= end]
    if ys:
        twin.step(xs, ys + [ys[-1]], where="post", color="#CC79A7", linewidth=2.4, alpha=0.45, zorder=1)


def shares(plan: dict[str, Any]) -> dict[str, float]:
    """Fraction of the elements each candidate sends under ``plan``."""
    total = sum(int(b.get("numel", 0)) for b in plan["buckets"]) or 1
    out: dict[str, float] = {}
    for b in plan["buckets"]:
        out[b["candidate"]] = out.get(b["candidate"], 0.0) + int(b.get("numel", 0)) / total
    return out


def fig_policy(col: Collection, pal: style.Palette, target: LossTarget | None = None):
    rows = [(s, r, load_policy(r)) for s in series(col) for r in s.runs[:1]]
    rows = [(s, r, p) for s, r, p in rows if p][:MAX_ROWS]
    if not rows:
        raise Skip("no run has a policy.jsonl (written by gradzip train --compressor auto)")
    cands = list(dict.fromkeys(c for _, _, plans in rows for p in plans for c in shares(p)))
    colors = {c: pal.color(c) for c in cands}
    fig, axes = style.new_figure(nrows=len(rows), sharex=True, width=7.2, height=1.6 * len(rows) + 1.0)
    for ax, (s, run, plans) in zip(axes, rows):
        end = max([int(m.get("step", 0)) for m in run.metrics] + [plans[-1]["step"] + 1])
        for i, p in enumerate(plans):
            x0, x1 = p["step"], plans[i + 1]["step"] if i + 1 < len(plans) else end
            bottom = 0.0
            for c, f in shares(p).items():
                ax.bar(x0, f, width=x1 - x0, bottom=bottom, align="edge", color=colors[c], edgecolor="white",
                       linewidth=0.4)
                bottom += f
        ax.set_ylim(0, 1)
        ax.set_ylabel("share of elements", fontsize=7.5)
        twin = ax.twinx()
        link = load_link(run)
        _draw_link(twin, link, end)
        twin.step([p["step"] for p in plans] + [end], [p["bandwidth_bps"] / 1e9 for p in plans]
                  + [plans[-1]["bandwidth_bps"] / 1e9], where="post", color="0.25", linewidth=1.2, linestyle="--")
        twin.plot([p["step"] for p in plans], [p["bandwidth_bps"] / 1e9 for p in plans], "o", color="0.25",
                  markersize=3)
        twin.set_yscale("log")
        twin.set_ylabel("link (Gbit/s)" if link else "measured link (Gbit/s)", fontsize=7.5)
        ax.set_title(f"{s.label}: {len(plans)} plan(s)", fontsize=8, loc="left")
    axes[-1].set_xlabel("optimizer step")
    handles = [Patch(facecolor=colors[c], label=c) for c in cands]
    traced = any(load_link(r) for _, r, _ in rows)
    if traced:
        handles.append(Line2D([], [], color="#CC79A7", linewidth=2.4, alpha=0.45, label="link rate set (link.jsonl)"))
    fig.legend(handles=handles, loc="lower center", ncol=min(3, len(handles)), fontsize=style.RC["legend.fontsize"],
               frameon=False, bbox_to_anchor=(0.5, 1.0))
    caption = ("What --compressor auto chose over each run (policy.jsonl): from each plan to the next, the share "
               "of the gradient's elements sent with each candidate; the dashed line is the link bandwidth the "
               "plan's probe measured (log scale, right axis), a dot per plan"
               + ("; the pale solid line, the rate the testbed's trace set (link.jsonl). " if traced else ". ")
               + fixed_caption(col))
    return fig, " ".join(caption.split())
