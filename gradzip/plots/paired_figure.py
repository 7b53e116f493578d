"""The ``delta_ci`` figure: each configuration's paired Δ final eval loss vs ``none`` with its 95%
t interval (:mod:`gradzip.plots.paired`), one row per configuration, coloured by verdict.

Registered in :data:`gradzip.plots.figures.DRAW`. Without seed groups that have a ``none``
baseline the figure does not apply and raises :class:`NotPaired`, which the default set of figures
passes over without a word (asked for by name, the reason is reported like any skip).
"""

from __future__ import annotations

from matplotlib.lines import Line2D

from gradzip.plots import style
from gradzip.plots.captions import fixed_caption
from gradzip.plots.grouping import Skip
from gradzip.plots.lowcomm import config_label
from gradzip.plots.paired import Paired
from gradzip.plots.results import Collection, LossTarget, Run
from gradzip.plots.table import paired_vs_none

# Verdict -> (colour, marker): colour-blind-safe colours, and a marker shape so print keeps them apart.
VERDICT_STYLE = {
    "worse": (style.OKABE_ITO["vermillion"], "s"),
    "better": (style.OKABE_ITO["bluish_green"], "D"),
    "within noise": ("#777777", "o"),
}


class NotPaired(Skip):
    """The runs have no seed group with a ``none`` baseline: ``delta_ci`` does not apply."""


def fig_delta_ci(col: Collection, pal: style.Palette, target: LossTarget | None = None):
    every = paired_vs_none(col)
    pairs = [(g, p) for g, p in every if p is not None]
    if not any(len(g) > 1 for g, _ in every) or not pairs:
        raise NotPaired("no seed groups with a none baseline of otherwise equal parameters")
    shown: list[tuple[list[Run], Paired]] = [(g, p) for g, p in pairs if p.n >= 2]
    few = [config_label(g[0], col) for g, p in pairs if p.n < 2]
    if not shown:
        raise Skip("no configuration has 2 seeds paired with its none baseline")

    fig, (ax,) = style.new_figure(width=7.2, height=min(14.0, 1.4 + 0.42 * len(shown)))
    for y, (_, p) in enumerate(shown):
        color, marker = VERDICT_STYLE[p.verdict]
        ax.errorbar([p.mean], [y], xerr=[[p.mean - p.lo], [p.hi - p.mean]], color=color, marker=marker,
                    markersize=6, capsize=3, linestyle="none")
        # Each seed's own difference, just below the bar (y grows downwards): what the interval summarises.
        ax.plot(p.values, [y + 0.2] * p.n, linestyle="none", marker="x", markersize=4, color=color, alpha=0.6)
    ax.axvline(0.0, color="black", linewidth=0.9)
    ax.set_yticks(range(len(shown)))
    ax.set_yticklabels([f"{config_label(g[0], col)} (n={p.n})" for g, p in shown], fontsize=7.5)
    ax.set_ylim(len(shown) - 0.5, -0.5)  # first configuration on top
    ax.grid(False, axis="y")
    ax.set_xlabel("paired Δ final eval loss vs none (nats; > 0 is worse)")
    ax.set_title("Paired Δ vs none with 95% t interval")
    present = [v for v in VERDICT_STYLE if any(p.verdict == v for _, p in shown)]
    ax.legend(handles=[Line2D([], [], color=VERDICT_STYLE[v][0], marker=VERDICT_STYLE[v][1], linestyle="none",
                              label=v) for v in present],
              fontsize=style.RC["legend.fontsize"], frameon=False, loc="best")
    caption = ("Each configuration's final held-out loss minus that of the none run of the same seed (otherwise "
               "equal parameters): the mean of these paired differences (marker) with its two-sided 95% Student "
               "t interval, mean ± t(0.975, n−1)·s/√n (bars), and each seed's difference (crosses below the bar). "
               "Right of the line at 0 is worse than none. Verdict (colour and marker): worse when the interval "
               "lies above 0, better when below, within noise when it holds 0."
               + (f" Not drawn (fewer than 2 paired seeds): {', '.join(few)}." if few else "")
               + " " + fixed_caption(col))
    return fig, " ".join(caption.split())
