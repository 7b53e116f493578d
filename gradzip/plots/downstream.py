"""Figure ``downstream_vs_bytes``: downstream accuracy against the bytes sent in pretraining.

One point per configuration, from each cell's ``downstream/summary.json`` (written by a sweep with
a ``[downstream]`` table, :mod:`gradzip.experiments.downstream`): y is the fine-tuned accuracy (the
mean over the fine-tuning seeds, then over the configuration's pretraining seeds), x the bytes one
worker sent over the pretraining run. Error bars: min–max over every fine-tuning run of the
configuration. Further left sends less; higher is better.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gradzip.plots import style
from gradzip.plots.captions import fixed_caption
from gradzip.plots.grouping import Skip
from gradzip.plots.lowcomm import _log_x, _place_labels, bytes_label, configurations
from gradzip.plots.results import Collection, LossTarget, Run


def load_downstream(run: Run) -> dict[str, Any] | None:
    """The cell's ``downstream/summary.json``, or None."""
    try:
        doc = json.loads((Path(run.dir) / "downstream" / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(doc, dict) and isinstance(doc.get("accuracy"), (int, float))
    return doc if ok else None


def points(col: Collection) -> list[tuple[str, str, float, float, float, float]]:
    """(label, compressor, bytes, accuracy, lowest, highest) per configuration with downstream results."""
    out = []
    for c in configurations(col):
        docs = [(r, d) for r in c.runs if (d := load_downstream(r)) is not None and r.bytes_total]
        if not docs:
            continue
        accs = [s["accuracy"] for _, d in docs for s in d.get("seeds", []) if isinstance(s.get("accuracy"), float)]
        mean = sum(d["accuracy"] for _, d in docs) / len(docs)
        out.append((c.label, c.compressor, sum(r.bytes_total for r, _ in docs) / len(docs), mean,
                    min(accs, default=mean), max(accs, default=mean)))
    return out


def fig_downstream_vs_bytes(col: Collection, pal: style.Palette, target: LossTarget | None = None):
    pts = points(col)
    if not pts:
        raise Skip("no run has downstream/summary.json (a sweep with a [downstream] table writes it)")
    fig, (ax,) = style.new_figure(width=6.4, height=4.0)
    for _, comp, x, y, lo, hi in pts:
        ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], marker="o", markersize=6, color=pal.color(comp),
                    linestyle="none", capsize=3, zorder=3)
    _log_x(ax, bytes_label)
    ax.set_xlabel("bytes sent per worker in pretraining (log scale; 1 MB = 10^6 B)")
    ax.set_ylabel("downstream accuracy (validation)")
    ax.set_title("Downstream accuracy against bytes sent")
    _place_labels(fig, ax, [(x, y, label) for label, _, x, y, _, _ in pts])
    caption = ("Fine-tuned accuracy on the validation split (downstream/summary.json: the mean over the fine-tuning "
               "seeds, then over the pretraining seeds) against the bytes one worker sent over pretraining "
               "(summary.json's bytes_total): further left sends less, higher is better. Error bars: the lowest "
               "and highest fine-tuning run of the configuration. " + fixed_caption(col))
    return fig, " ".join(caption.split())
