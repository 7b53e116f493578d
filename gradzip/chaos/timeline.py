"""The chaos run's timeline: every line its groups append to ``ft.jsonl`` and ``metrics.jsonl``,
stamped with the time the harness read it (:mod:`gradzip.chaos.harness`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol


class Incarnation(Protocol):
    """What the timeline reads of a group's process: its group, incarnation and output directory."""

    group: int
    inc: int
    out: Path


class Timeline:
    """Tails every group process's ``ft.jsonl`` and ``metrics.jsonl`` and appends each new line,
    stamped, to ``timeline.jsonl``; keeps the ft records in memory for the harness's decisions."""

    def __init__(self, path: Path, t_start: float) -> None:
        self.f = path.open("a", encoding="utf-8")
        self.t_start = t_start
        self.offsets: dict[Path, int] = {}
        self.ft: list[dict[str, Any]] = []

    def poll(self, procs: list[Incarnation]) -> None:
        now = time.monotonic() - self.t_start
        for p in procs:
            for name in ("ft.jsonl", "metrics.jsonl"):
                for rec in self._new_lines(p.out / name):
                    row = {"t": round(now, 3), "group": p.group, "inc": p.inc}
                    if name == "ft.jsonl":
                        row.update(kind="ft", rec=rec)
                        self.ft.append(row)
                    else:
                        row.update(kind="step", step=rec.get("step"), loss=rec.get("loss"),
                                   eval_loss=rec.get("eval_loss"))
                    self.f.write(json.dumps(row) + "\n")
        self.f.flush()

    def _new_lines(self, path: Path) -> list[dict[str, Any]]:
        if not path.exists():
            return []
        off = self.offsets.get(path, 0)
        with path.open("rb") as f:
            f.seek(off)
            data = f.read()
        end = data.rfind(b"\n") + 1  # complete lines only
        self.offsets[path] = off + end
        return [json.loads(line) for line in data[:end].decode().splitlines() if line.strip()]

    def close(self) -> None:
        self.f.close()
