"""``gradzip plot DIR``: figures (PNG + PDF), captions and the results table of a run or a sweep.

Writes, under ``--out`` (default: ``DIR`` itself):

- ``figures/NAME.png`` and ``figures/NAME.pdf`` for each figure the data supports;
- ``figures/figures.md``: each figure's caption (and the figures skipped, with the reason);
- ``results.md`` and ``results.csv``: one row per run.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from gradzip.errors import GradzipError
from gradzip.io import atomic_write_text
from gradzip.plots.figures import draw_all
from gradzip.plots.results import FIGURES, Collection, Target, load_runs, results_csv, results_markdown


@dataclass
class Report:
    table: str  # results.md's text
    results: list[Path]
    figures: list  # list[figures.Drawn]
    skipped: list[tuple[str, str]]
    figures_md: Path


def make_report(path: str | Path, out: str | Path | None = None, figures: list[str] | None = None,
                target: Target | None = None, captions: dict[str, str] | None = None) -> Report:
    """Load the runs under ``path`` and write figures, captions and tables (see module doc).

    ``figures``/``captions``/``target`` default to the sweep spec's ``[plot]``/``[target]``.
    """
    col: Collection = load_runs(path)
    out_dir = Path(out) if out else col.root
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_opts = col.spec.get("plot") or {}
    figures = figures or plot_opts.get("figures") or None
    for f in figures or []:
        if f not in FIGURES:
            raise GradzipError(f"unknown figure {f!r}; choose from {', '.join(FIGURES)}")
    target = target or col.target
    captions = {**(plot_opts.get("captions") or {}), **(captions or {})}

    table = results_markdown(col, target)
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="a run directory (gradzip train --out) or a sweep directory")
    parser.add_argument("--out", metavar="DIR", help="where to write figures/ and results.* (default: DIR)")
    parser.add_argument("--figures", metavar="LIST",
                        help=f"comma-separated figures to draw (default: all the data supports): {', '.join(FIGURES)}")
    parser.add_argument("--target", type=float, metavar="LOSS",
                        help="loss for the time-to-target columns (default: the sweep spec's [target])")
    parser.add_argument("--target-metric", choices=("loss", "eval_loss"), default="loss",
                        help="with --target: EMA-smoothed training loss (default) or eval loss")


def run(args: argparse.Namespace) -> int:
    figures = [f.strip() for f in args.figures.split(",") if f.strip()] if args.figures else None
    target = Target(args.target, args.target_metric) if args.target is not None else None
    print_report(make_report(args.dir, args.out, figures, target))
    return 0
