"""Sub-command tables (``gradzip`` and ``gradzip bench``): each sub-command is a module that
provides ``add_arguments(parser)`` and ``run(args) -> int``, imported when the parser is built."""

from __future__ import annotations

import argparse
import importlib


def add_subcommands(sub: argparse._SubParsersAction, table: dict[str, tuple[str, str]], attr: str) -> None:
    """One sub-parser per ``name -> (module, help)``; the module's ``add_arguments`` fills it and
    ``args.<attr>`` names the module to run. Sub-commands whose module is missing still show in --help."""
    for name, (module, help_) in table.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(**{attr: module})
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("gradzip"):
                raise
