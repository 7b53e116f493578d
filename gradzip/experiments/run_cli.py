"""``gradzip run NAME``: run an experiment spec that ships with gradzip.

The specs live in ``gradzip/experiments/specs/NAME.toml`` (package data). ``gradzip run --list``
lists them with their descriptions and sizes. A run is a sweep (see :mod:`gradzip.experiments.sweep`)
into ``--out`` (default ``runs/NAME``); it ends by printing the results table and the paths of
the figures. Re-running the same command skips finished cells, so an interrupted run continues.
"""

from __future__ import annotations

import argparse
import warnings
from importlib import resources
from pathlib import Path

from gradzip.errors import GradzipError
from gradzip.experiments import sweep
from gradzip.experiments.spec import Spec, load_spec


def spec_dir() -> Path:
    return Path(str(resources.files("gradzip.experiments") / "specs"))


def shipped() -> dict[str, Path]:
    """Name -> path of every shipped spec, sorted by name (``quickstart`` first)."""
    d = spec_dir()
    found = {p.stem: p for p in sorted(d.glob("*.toml"))} if d.is_dir() else {}
    return dict(sorted(found.items(), key=lambda kv: (kv[0] != "quickstart", kv[0])))


def load_shipped(name: str) -> Spec:
    specs = shipped()
    if name not in specs:
        raise GradzipError(f"no shipped spec named {name!r}; choose one of: {', '.join(specs) or '(none)'} "
                           "(or run your own file with `gradzip sweep SPEC.toml`)")
    return load_spec(specs[name])


def list_specs() -> int:
    specs = shipped()
    if not specs:
        print("no specs ship with this installation")
        return 0
    width = max(len(n) for n in specs)
    for name, path in specs.items():
        try:
            with warnings.catch_warnings():  # a cell's caveats belong to running it, not to the list
                warnings.simplefilter("ignore")
                spec = load_spec(path)
            line = f"{spec.description} [{len(spec.cells)} cells]"
        except GradzipError as e:  # a broken shipped spec is listed, not fatal to --list
            line = f"(invalid: {e})"
        print(f"{name.ljust(width)}  {line}")
    print("\nrun one with `gradzip run NAME`; see a spec with `gradzip run NAME --show`")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", metavar="NAME", help="a shipped spec (see --list), e.g. quickstart")
    parser.add_argument("--list", action="store_true", help="list the shipped specs and exit")
    parser.add_argument("--show", action="store_true", help="print the spec's TOML and exit")
    sweep.add_common_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.list:
        return list_specs()
    if not args.name:
        raise GradzipError("give the name of a shipped spec (see `gradzip run --list`), e.g. `gradzip run quickstart`")
    spec = load_shipped(args.name)
    if args.show:
        print(spec.path.read_text(encoding="utf-8"), end="")
        return 0
    out = Path(args.out) if args.out else sweep.default_out(spec)
    if args.dry_run:
        return sweep.dry_run(spec, out)
    print(f"gradzip run {spec.name}: {spec.description}\n{len(spec.cells)} cells into {out}", flush=True)
    command = f"gradzip run {spec.name}" + (f" --out {args.out}" if args.out else "") \
        + (f" --jobs {args.jobs}" if args.jobs != 1 else "")
    results = sweep.run_sweep(spec, out, in_process=args.in_process, command=command, jobs=args.jobs)
    return sweep.finish(out, results, plot=not args.no_plot)
