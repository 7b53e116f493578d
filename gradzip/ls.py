"""``gradzip ls``: list the registered compressors, their collective, bias, declared capabilities
(schemes, per-tensor, identity), parameters and defaults; then the ``--sync`` modes (table only).

Every compressor file registered with :func:`gradzip.compress.registry.register` shows up without
any edit here. ``--json`` prints the same as a machine-readable list.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from gradzip.compress.registry import describe, registry
from gradzip.engine.modes import load_modes
from gradzip.plan.sync import MODES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def rows() -> list[dict[str, Any]]:
    """One dict per registered compressor, sorted by name."""
    out = []
    for name, cls in registry().items():
        out.append({
            "name": name,
            "collective": cls.collective,
            "rounds": cls.rounds,
            "biased": cls.biased,
            "lossless": cls.lossless,
            "schemes": list(cls.schemes),
            "default_exchange": cls.collective,
            "per_tensor": cls.per_tensor,
            "identity": cls.identity,
            "parameters": [{"name": p, "type": t, "default": d} for p, t, d in describe(cls)],
            "description": cls.description,
        })
    return out


def table(items: list[dict[str, Any]]) -> str:
    """The aligned text table that ``gradzip ls`` prints."""
    header = ("NAME", "COLLECTIVE", "BIASED", "EXCHANGE (*default)", "PARAMETERS (default)", "DESCRIPTION")
    lines = [header]
    for it in items:
        coll = it["collective"] + (f" x{it['rounds']}" if it["rounds"] > 1 else "")
        schemes = "|".join(s + ("*" if s == it["default_exchange"] else "") for s in it["schemes"])
        params = ",".join(f"{p['name']}={_fmt(p['default'])}" for p in it["parameters"] if p["name"] != "exchange")
        lines.append((it["name"], coll, "yes" if it["biased"] else "no", schemes, params, it["description"]))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header) - 1)]
    text = ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in lines]
    text.append("")
    text.append('spec: NAME or NAME:key=value,... e.g. "topk:ratio=0.01,ef=true"; ef=true wraps any compressor in '
                "error feedback (ef_decay=B scales its memory by B each step); exchange=SCHEME picks how payloads "
                "combine (twophase: compressed allreduce). "
                "\"x2\": rounds of communication per step.")
    text.append("")
    text.append("SYNC (--sync)  when workers exchange; the compressor applies to what each sync sends")
    load_modes()  # a mode in its own file registers its spelling at import
    width = max(len(m) for m in MODES)
    text.extend(f"{m.ljust(width)}  {why}" for m, why in MODES.items())
    return "\n".join(text)


def run(args: argparse.Namespace) -> int:
    items = rows()
    if getattr(args, "json", False):
        print(json.dumps(items, indent=2, default=str))
    else:
        print(table(items))
    return 0
