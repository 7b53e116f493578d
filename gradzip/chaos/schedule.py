"""The fault schedule of a chaos run: a pure function of its seed and settings.

Faults arrive as a Poisson process of ``rate`` faults per minute (``--faults-per-minute``) over
the whole run (exponential inter-arrival times of mean 60 / rate seconds), from ``start`` seconds
after the founding sync to ``duration`` seconds. Each fault draws its kind uniformly from ``kinds``
and its target uniformly among the groups (a partition's target is a host). A kill or stall whose
group is down, restarting (its new process has not rejoined yet) or stalled when it comes is
skipped at run time (the harness records it): faults hit live groups, at ``rate`` / ``groups`` a
minute each, which is the goodput model's failure process. The schedule itself does not depend on
what the run did, so two runs with one seed inject the same faults at the same times.

Kinds:

- ``kill``: ``kill -9`` of the group's process; after ``recovery`` seconds a fresh process of the
  same group starts (a late joiner: it heals from a live peer);
- ``stall``: SIGSTOP, then SIGCONT after ``stall`` seconds (a straggler: dropped from the quorum
  when its heartbeat expires, it heals when it resumes);
- ``partition``: every packet the target host sends is dropped for ``partition`` seconds.

A late join (a group that starts after the others) is not drawn: ``late`` groups, the last ones,
start at fixed times given by the run (:func:`late_starts`).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

from gradzip.errors import GradzipError

KINDS = ("kill", "stall", "partition")


@dataclass(frozen=True)
class ScheduledFault:
    """One scheduled fault: at ``t`` seconds (from the founding sync), ``kind`` on ``target`` (a
    group index; a host index for a partition), lasting ``duration`` seconds (the restart delay of
    a kill, the stall, the partition)."""

    t: float
    kind: str
    target: int
    duration: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_kinds(text: str) -> tuple[str, ...]:
    """``kill,stall,partition`` (any non-empty subset): the kinds, checked; one line otherwise."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise GradzipError(f"--kinds {text!r}: give a comma-separated subset of {', '.join(KINDS)}")
    return kinds


def build(seed: int, rate: float, duration: float, groups: int, hosts: int, kinds: tuple[str, ...],
          recovery: float, stall: float, partition: float, start: float = 0.0) -> list[ScheduledFault]:
    """The faults of a run (module docstring), in time order. ``rate`` is in faults per minute (0:
    none); targets are drawn from one ``random.Random(seed)`` stream in arrival order."""
    if not (rate >= 0 and rate < float("inf")):
        raise GradzipError(f"--faults-per-minute must be a finite number >= 0, got {rate:g}")
    if groups < 1 or hosts < 1:
        raise GradzipError(f"a chaos run needs at least one group and one host, got {groups} and {hosts}")
    rng = random.Random(seed)
    lengths = {"kill": recovery, "stall": stall, "partition": partition}
    out: list[ScheduledFault] = []
    t = start
    while rate > 0:
        t += rng.expovariate(rate / 60.0)
        if t >= duration:
            break
        kind = kinds[rng.randrange(len(kinds))]
        target = rng.randrange(hosts if kind == "partition" else groups)
        out.append(ScheduledFault(round(t, 3), kind, target, lengths[kind]))
    return out


def late_starts(groups: int, late: int, at: float) -> dict[int, float]:
    """The last ``late`` groups start ``at``, 2·``at``, … seconds after the founders' founding sync."""
    if not 0 <= late < groups:
        raise GradzipError(f"--late {late}: at most {groups - 1} of the {groups} groups can start late "
                           "(the others found the run)")
    return {groups - late + i: at * (i + 1) for i in range(late)}
