"""Small file helpers shared by every part: atomic writes and JSON-lines reading.

Atomic: the text goes to a temporary file in the same directory, then ``os.replace`` renames it
over the target, so a reader (or a crash) never sees a half-written file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def atomic_write_text(path: str | os.PathLike[str], text: str, fsync: bool = False) -> None:
    """Write ``text`` to ``path`` atomically (``fsync=True`` also makes it durable)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike[str], obj: Any, indent: int | None = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, default=str) + "\n")


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSON-lines file ([] if it does not exist). A torn line (a crash while it
    was written) is skipped: the records before it are still good."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
