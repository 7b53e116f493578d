"""``gradzip export RUN_DIR --to hf OUT_DIR [--step N]``: write a run's checkpoint as a directory
that ``transformers`` loads (:func:`gradzip.training.export.export_hf`). Bad input is one line,
exit code 2, and nothing is written."""

from __future__ import annotations

import argparse

from gradzip.errors import GradzipError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --out directory of a gradzip train run")
    parser.add_argument("--to", nargs=2, metavar=("FORMAT", "OUT_DIR"), required=True,
                        help="the format (hf: Hugging Face transformers) and a new or empty directory to write")
    parser.add_argument("--step", type=int, default=None, metavar="N",
                        help="export the checkpoint of step N (default: the newest)")


def run(args: argparse.Namespace) -> int:
    # Imported here: `gradzip --help` builds every sub-command's parser and should not load torch for it.
    from gradzip.training.export import FORMATS, export_hf

    fmt, out = args.to
    if fmt not in FORMATS:
        raise GradzipError(f"--to {fmt}: unknown format; the formats are {', '.join(FORMATS)} (e.g. --to hf OUT_DIR)")
    if args.step is not None and args.step < 0:
        raise GradzipError(f"--step must be >= 0, got {args.step}")
    path = export_hf(args.run_dir, out, step=args.step)
    print(f"gradzip export: wrote {path} (config.json, model.safetensors, tokenizer files, README.md); "
          f"load it with transformers' BertForPreTraining.from_pretrained({str(path)!r})")
    return 0
