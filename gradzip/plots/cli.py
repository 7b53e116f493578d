"""``gradzip plot DIR``: figures (PNG + PDF), captions and the results table of a run or a sweep
(what is written: :mod:`gradzip.plots.report`)."""

from __future__ import annotations

import argparse

from gradzip.plots.report import make_report, print_report
from gradzip.plots.results import FIGURE_CHOICES, LossTarget


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="a run directory (gradzip train --out) or a sweep directory")
    parser.add_argument("--out", metavar="DIR", help="where to write figures/ and results.* (default: DIR)")
    parser.add_argument("--figures", metavar="LIST",
                        help=f"comma-separated figures to draw (default: all the data supports): {FIGURE_CHOICES}, "
                        "e.g. eval_mlm_acc_steps")
    parser.add_argument("--target", type=float, metavar="LOSS",
                        help="loss for the time-to-target columns (default: the sweep spec's [target])")
    parser.add_argument("--target-metric", choices=("loss", "eval_loss"), default="loss",
                        help="with --target: EMA-smoothed training loss (default) or eval loss")
    parser.add_argument("--target-bandwidths", metavar="LIST",
                        help="comma-separated link bandwidths (e.g. 100mbit,1gbit) at which to model the time to the "
                        "target (columns time_to_target_<B>_s, figure time_to_target; default: the spec's [target] "
                        "bandwidths)")


def run(args: argparse.Namespace) -> int:
    figures = [f.strip() for f in args.figures.split(",") if f.strip()] if args.figures else None
    target = LossTarget(args.target, args.target_metric) if args.target is not None else None
    bandwidths = ([b.strip() for b in args.target_bandwidths.split(",") if b.strip()]
                  if args.target_bandwidths else None)
    print_report(make_report(args.dir, args.out, figures, target, bandwidths=bandwidths))
    return 0
