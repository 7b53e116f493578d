"""The report of a run or a sweep: figures (PNG + PDF), captions and the results table.

Writes, under ``out`` (default: the directory itself):

- ``figures/NAME.png`` and ``figures/NAME.pdf`` for each figure the data supports;
- ``figures/figures.md``: each figure's caption (and the figures skipped, with the reason);
- ``results.md`` and ``results.csv``: one row per run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from gradzip.errors import GradzipError
from gradzip.io import atomic_write_text
from gradzip.plots.downstream_table import downstream_markdown
from gradzip.plots.figures import draw_all
from gradzip.plots.results import FIGURE_CHOICES, Collection, LossTarget, is_figure, load_runs
from gradzip.plots.retime import bandwidth_columns
from gradzip.plots.table import results_csv, results_markdown


@dataclass
class Report:
    table: str  # results.md's text
    results: list[Path]
    figures: list  # list[figures.Drawn]
    skipped: list[tuple[str, str]]
    figures_md: Path


def make_report(path: str | Path, out: str | Path | None = None, figures: list[str] | None = None,
                target: LossTarget | None = None, captions: dict[str, str] | None = None,
                bandwidths: list[str] | None = None) -> Report:
    """Load the runs under ``path`` and write figures, captions and tables (see module doc).

    ``figures``/``captions``/``target`` default to the sweep spec's ``[plot]``/``[target]``;
    ``bandwidths`` (e.g. ``["100mbit", "1gbit"]``) replace the target's ``bandwidths``, the links
    at which the time to target is modelled (:mod:`gradzip.plots.retime`). GradzipError (one line)
    for an unknown figure, a bad bandwidth, or bandwidths without a target.
    """
    col: Collection = load_runs(path)
    out_dir = Path(out) if out else col.root
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_opts = col.spec.get("plot") or {}
    figures = figures or plot_opts.get("figures") or None
    for f in figures or []:
        if not is_figure(f):
            raise GradzipError(f"unknown figure {f!r}; choose from {FIGURE_CHOICES}")
    spec_target = col.target
    target = target or spec_target
    if not bandwidths and target is not None and not target.bandwidths and spec_target is not None:
        bandwidths = spec_target.bandwidths  # --target LOSS keeps the spec's [target] bandwidths
    if bandwidths:
        if target is None:
            raise GradzipError("--target-bandwidths needs a target loss: give --target LOSS (or a spec with [target])")
        target = dataclasses.replace(target, bandwidths=list(bandwidths))
    if target is not None:
        try:
            bandwidth_columns(target.bandwidths)
        except GradzipError as e:
            raise GradzipError(f"target bandwidths: {e}") from None
    captions = {**(plot_opts.get("captions") or {}), **(captions or {})}

    table = results_markdown(col, target) + downstream_markdown(col)
    md, csv_path = out_dir / "results.md", out_dir / "results.csv"
    title = col.spec.get("name") or col.root.name
    atomic_write_text(md, f"# Results: {title}\n\n{table}")
    atomic_write_text(csv_path, results_csv(col, target))

    fig_dir = out_dir / "figures"
    drawn, skipped = draw_all(col, fig_dir, figures, captions, target)
    lines = [f"# Figures: {title}", ""]
    if col.spec.get("description"):
        lines += [col.spec["description"], ""]
    if (col.sweep or {}).get("command"):
        lines += [f"Made with `{col.sweep['command']}`.", ""]
    for d in drawn:
        png = next(p for p in d.paths if p.suffix == ".png")
        lines += [f"## {d.name}", "", f"![{d.name}]({png.name})", "", d.caption, ""]
    if skipped:
        lines += ["## Not drawn", ""] + [f"- `{n}`: {why}." for n, why in skipped] + [""]
    fig_dir.mkdir(parents=True, exist_ok=True)
    figures_md = fig_dir / "figures.md"
    atomic_write_text(figures_md, "\n".join(lines))
    return Report(table, [md, csv_path], drawn, skipped, figures_md)


def print_report(rep: Report) -> None:
    print(rep.table)
    for d in rep.figures:
        print(f"figure {d.name}: " + "  ".join(str(p) for p in d.paths))
    for name, why in rep.skipped:
        print(f"skipped figure {name}: {why}")
    print(f"captions: {rep.figures_md}")
    print("results: " + "  ".join(str(p) for p in rep.results))
