"""The processes of a chaos run's groups: a process and all its descendants (``gradzip train``
runs its ranks as children in sessions of their own), signals to all of them, and the CPU priority
of a warm spare (:mod:`gradzip.chaos.harness`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

SPARE_NICE = 19  # a spare starts at the lowest CPU priority: its start-up takes no CPU from the live groups


def children() -> dict[int, list[int]]:
    """Every process's children, from /proc (ppid is the 4th field of /proc/PID/stat)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents first."""
    kids, out, todo = children(), [], [pid]
    while todo:
        q = todo.pop(0)
        out.append(q)
        todo.extend(kids.get(q, []))
    return out


def nice_spare() -> None:
    """In a spare's process before it executes: the lowest CPU priority."""
    os.nice(SPARE_NICE)


def renice(pid: int, nice: int) -> bool:
    """``pid`` and its descendants back to niceness ``nice`` (lowering it needs root); False when refused,
    and the spare then trains at its start-up priority."""
    try:
        for q in tree(pid):
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, q, nice)
    except PermissionError:
        return False
    return True


def signal_tree(pid: int, sig: int) -> None:
    """``sig`` to the group's process and every descendant (``gradzip train`` runs its rank as a
    child in a session of its own, so the process group is not enough)."""
    for q in tree(pid):
        try:
            os.kill(q, sig)
        except ProcessLookupError:
            pass
