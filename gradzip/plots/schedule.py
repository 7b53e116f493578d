"""Figure ``schedule``: one training step's timeline, drawn from each run's ``schedule.json``.

Two lanes per run. The *compute thread*: forward and backward, each bucket's encode (drawn where
it interrupts backward), the waits for the link once backward is done, the work between rounds
(PowerSGD) and the decodes. The *link*: each round of each bucket in flight. Reading it: a bucket
whose link bar starts as soon as its encode ends travelled while backward went on; a wait on the
compute thread is communication that nothing hid (the step-time breakdown's "exposed
communication"). On ``sim`` the spans are the virtual clock's (:mod:`gradzip.cluster.schedule`);
on real backends they are rank 0's measured timestamps, where a link bar runs from the launch to
the end of the wait (an upper bound of the transfer).
"""

from __future__ import annotations

import json
from typing import Any

from matplotlib.patches import Patch

from gradzip.plots import style
from gradzip.plots.captions import clock_caption, fixed_caption
from gradzip.plots.grouping import Series, Skip, series
from gradzip.plots.results import Collection, LossTarget, Run

MAX_ROWS = 8
# Compute-thread span kinds -> (colour, legend label); waits are the exposed communication.
KINDS = {
    "backward": (style.PHASES["compute"], "forward + backward"),
    "encode": (style.PHASES["compress"], "encode / decode"),
    "between": (style.PHASES["compress"], "encode / decode"),
    "decode": (style.PHASES["compress"], "encode / decode"),
    "wait": (style.PHASES["comm"], "waiting for the link (exposed)"),
}
LINK = ("#009E73", "#7FCEB9")  # link rounds, alternating by bucket so neighbours stay apart


def load_schedule(run: Run) -> dict[str, Any] | None:
    """The run's ``schedule.json``, or None when it has none (older runs, ``--sync diloco``) or it
    cannot be read."""
    path = run.dir / "schedule.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("spans"), list):
        return None
    # A hand-edited or foreign file: skip the run rather than fail the whole plot on a bad span.
    ok = all(isinstance(sp, dict) and sp.get("lane") in ("compute", "link")
             and isinstance(sp.get("start"), int | float) and isinstance(sp.get("end"), int | float)
             for sp in doc["spans"])
    return doc if ok else None


def _rows(col: Collection) -> list[tuple[Series, Run, dict[str, Any]]]:
    """One row per series (its first seed that has a schedule), at most MAX_ROWS."""
    rows = []
    for s in series(col):
        for r in s.runs:
            doc = load_schedule(r)
            if doc and doc["spans"]:
                rows.append((s, r, doc))
                break
    return rows[:MAX_ROWS]


def fig_schedule(col: Collection, pal: style.Palette, target: LossTarget | None = None):
    rows = _rows(col)
    if not rows:
        raise Skip("no run has a schedule.json (written by gradzip train with --sync step)")
    peak = max(max(sp["end"] for sp in doc["spans"]) for _, _, doc in rows)
    scale, unit = (1e3, "ms") if peak < 2 else (1.0, "s")
    fig, axes = style.new_figure(nrows=len(rows), sharex=True, width=7.2, height=0.95 * len(rows) + 1.2)
    for ax, (s, run, doc) in zip(axes, rows):
        for sp in doc["spans"]:
            x, w = sp["start"] * scale, (sp["end"] - sp["start"]) * scale
            if sp["lane"] == "link":
                color = LINK[(sp.get("bucket") or 0) % 2]
                ax.broken_barh([(x, w)], (0.1, 0.8), facecolors=color, edgecolor="white", linewidth=0.3)
            else:
                ax.broken_barh([(x, w)], (1.1, 0.8), facecolors=KINDS.get(sp["kind"], ("#999999", ""))[0],
                               edgecolor="white", linewidth=0.3)
        ax.set_yticks([0.5, 1.5], ["link", "compute"], fontsize=7.5)
        ax.set_ylim(0, 2)
        ax.grid(axis="y", visible=False)
        ax.set_title(f"{s.label}  (step {doc.get('step')}, {doc.get('clock', run.clock)})", fontsize=8, loc="left")
    axes[-1].set_xlabel(f"time since the step's forward began ({unit})")
    handles, seen = [], set()
    for color, label in KINDS.values():
        if label not in seen:
            seen.add(label)
            handles.append(Patch(facecolor=color, label=label))
    handles.append(Patch(facecolor=LINK[1], label="a bucket's round on the link"))
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=style.RC["legend.fontsize"], frameon=False,
               bbox_to_anchor=(0.5, 1.0))
    caption = ("One step's schedule per configuration (the run's last step, from schedule.json): on the compute "
               "thread, forward and backward interrupted by each bucket's encode, then the waits for the link "
               "(exposed communication) and the decodes; on the link, each bucket's rounds, alternating shades "
               "by bucket. A link bar that starts where its encode ends is a bucket that travelled while "
               "backward went on. " + clock_caption([r for _, r, _ in rows]) + " " + fixed_caption(col))
    return fig, " ".join(caption.split())
