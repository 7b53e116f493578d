"""The ``gradzip`` command. Each sub-command lives in its own module, imported on use, which
provides ``add_arguments(parser)`` and ``run(args) -> int``.

Bad input anywhere raises :class:`gradzip.errors.GradzipError`: printed as one line
(``gradzip CMD: error: ...``), exit code 2, no traceback. A failed collective
(:class:`gradzip.errors.CommError`, naming the operation and the lost rank) is one line too, exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

# Before torch is imported (sub-command modules import it): torch's C++ warnings stay off the
# terminal unless GRADZIP_DEBUG=1 (see gradzip.comm.launch.quiet_torch_logs, which ranks inherit).
if not os.environ.get("GRADZIP_DEBUG"):
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from gradzip import __version__  # noqa: E402
from gradzip.bench.cli import BENCHMARKS
from gradzip.errors import CommError, GradzipError, TrainingError
from gradzip.subcommands import add_subcommands

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("gradzip.training.cli", "pretrain BERT under a compressor and backend"),
    "sweep": ("gradzip.experiments.sweep", "run every cell of an experiment spec (TOML)"),
    "run": ("gradzip.experiments.run_cli", "run a spec that ships with gradzip (--list to list them)"),
    "plot": ("gradzip.plots.cli", "draw figures and the results table of a run or sweep"),
    "export": ("gradzip.training.export_cli", "write a run's checkpoint as a Hugging Face model directory"),
    "finetune": ("gradzip.training.finetune_cli", "fine-tune a pretrained checkpoint for sequence classification"),
    "bench": ("gradzip.bench.cli", f"benchmarks: {', '.join(BENCHMARKS)}"),
    "ls": ("gradzip.ls", "list the registered compressors"),
    "simulate": ("gradzip.cluster.simulate_cli", "predict step time of a large cluster (cost model)"),
    "netem": ("gradzip.netem.cli", "emulated hosts with shaped links (namespaces + tc)"),
    "chaos": ("gradzip.chaos.cli", "fault-tolerant DiLoCo groups under injected faults (kills, stalls, partitions)"),
    "env": ("gradzip.env", "print versions and available backends (for bug reports)"),
}
# Commands that parse --sync when they run: every registered mode's spelling is loaded first
# (a mode registers it when its module in gradzip.engine is imported; the cost model sits below
# the engine and cannot import it).
SYNC_COMMANDS = ("simulate",)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gradzip", description="Communication-efficient distributed training.")
    parser.add_argument("--version", action="version", version=f"gradzip {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    add_subcommands(sub, COMMANDS, "_module")
    return parser


def _one_line_warning(message: Warning | str, category: type[Warning], *args: object, **kwargs: object) -> str:
    return f"gradzip: warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _one_line_warning  # type: ignore[assignment]
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        if args.command in SYNC_COMMANDS:
            from gradzip.engine.modes import load_modes

            load_modes()
        code = importlib.import_module(args._module).run(args)
    except GradzipError as e:
        sys.stderr.write(f"gradzip {args.command}: error: {e}\n")
        return 2
    except TrainingError as e:
        sys.stderr.write(f"gradzip {args.command}: error: {e}\n")
        return 1
    except CommError as e:  # a lost peer or timeout: the message names the op and the rank
        sys.stderr.write(f"gradzip {args.command}: communication error: {e}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("gradzip: interrupted\n")
        return 130
    except BrokenPipeError:  # `gradzip ls | head`: the reader left; no traceback at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
