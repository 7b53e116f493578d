"""The one shared style of every gradzip figure.

- Colours: the Okabe–Ito palette (safe for the common colour-vision deficiencies). The ``none``
  baseline is always black; other compressors take the palette in order of first appearance, so
  within one ``gradzip plot`` a compressor keeps its colour in every figure. Yellow comes last: it
  is hard to see on white.
- A second distinguishing parameter (e.g. gradient accumulation) changes line style and marker,
  never colour, so colour always means "compressor".
- Figures are written with the Agg backend as PNG (150 dpi) and PDF (vector).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator  # noqa: E402

OKABE_ITO = {
    "black": "#000000",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "bluish_green": "#009E73",
    "orange": "#E69F00",
    "reddish_purple": "#CC79A7",
    "sky_blue": "#56B4E9",
    "yellow": "#F0E442",
}
CYCLE = [OKABE_ITO[k] for k in ("blue", "vermillion", "bluish_green", "orange", "reddish_purple", "sky_blue",
                                "yellow")]
LINESTYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P", "X"]
# Phase colours of the step-time bars (not compressor colours).
PHASES = {"compute": OKABE_ITO["blue"], "compress": OKABE_ITO["orange"], "comm": OKABE_ITO["vermillion"],
          "opt": "#999999"}

RC = {
    "figure.figsize": (6.4, 4.0),
    "figure.dpi": 100,
    "savefig.dpi": 150,
    "savefig.bbox": "tight",
    "font.size": 9.5,
    "axes.titlesize": 10,
    "axes.labelsize": 9.5,
    "legend.fontsize": 8,
    "legend.frameon": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "lines.linewidth": 1.6,
    "lines.markersize": 4.5,
    "pdf.fonttype": 42,  # TrueType in PDFs, so text stays text in papers
    "axes.prop_cycle": matplotlib.cycler(color=CYCLE),
}


class Palette:
    """Stable colours per compressor and styles per secondary key, within one plotting session."""

    def __init__(self) -> None:
        self._colors: dict[str, str] = {}
        self._styles: dict[str, int] = {}

    def color(self, compressor: str) -> str:
        if compressor.split(":", 1)[0].strip().lower() == "none":
            return OKABE_ITO["black"]
        if compressor not in self._colors:
            self._colors[compressor] = CYCLE[len(self._colors) % len(CYCLE)]
        return self._colors[compressor]

    def style(self, key: str) -> tuple[str, str]:
        """(linestyle, marker) of a secondary key ('' gives the default)."""
        if key not in self._styles:
            self._styles[key] = len(self._styles)
        i = self._styles[key]
        return LINESTYLES[i % len(LINESTYLES)], MARKERS[i % len(MARKERS)]


def new_figure(ncols: int = 1, width: float | None = None, height: float | None = None, sharey: bool = False,
               nrows: int = 1, sharex: bool = False):
    """A figure of ``nrows × ncols`` axes in the shared style (returns ``fig, flat_list_of_axes``)."""
    w = width or (6.4 if ncols == 1 else min(3.6 * ncols, 16.0))
    h = height or (4.0 if nrows == 1 else min(2.9 * nrows, 14.0))
    with plt.rc_context(RC):
        fig, axes = plt.subplots(nrows, ncols, figsize=(w, h), sharex=sharex, sharey=sharey, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat:
        _apply(ax)
    return fig, flat


def _apply(ax) -> None:
    # rc_context only applies while the figure is created; set the per-axes look explicitly.
    ax.grid(True, alpha=RC["grid.alpha"], linewidth=RC["grid.linewidth"])
    ax.spines["top"].set_visible(False)
    ax.spines["right"].set_visible(False)
    ax.tick_params(labelsize=RC["font.size"] - 1)


def legend(ax, **kw) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=RC["legend.fontsize"], frameon=False, **kw)


def save(fig, out_dir: Path, name: str) -> list[Path]:
    """Write ``name.png`` and ``name.pdf``; close the figure; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    with plt.rc_context(RC):
        fig.tight_layout()
        for ext in ("png", "pdf"):
            p = out_dir / f"{name}.{ext}"
            tmp = out_dir / f".{name}.tmp.{ext}"
            fig.savefig(tmp, format=ext)
            tmp.replace(p)  # never leave a half-written figure under the real name
            paths.append(p)
    plt.close(fig)
    return paths


def log_y(ax) -> None:
    """Log y axis with plain numbers (1, 2, 5, 10, ... not 10^0, 2×10^0)."""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}"))


def bandwidth_label(bps: float) -> str:
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"
