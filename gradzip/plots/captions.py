"""The sentences and labels every figure's caption shares: the clock of a time axis, the fixed
parameters, the seeds averaged, and how a parameter's value is written."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from gradzip.plots.results import Collection, Run

CLOCK_TEXT = {
    "modelled": "modelled (the sim backend's virtual clock: computation timed in one-thread CPU time, which "
                "other processes on the machine and its core count do not change, plus communication from the "
                "α–β cost model of the link)",
    "measured": "measured (wall-clock time of the real backend)",
}

# The parameters a caption's "Fixed:" sentence names when they do not vary, in this order.
FIXED_KEYS = ("model", "backend", "workers", "bandwidth", "latency", "batch_size", "accumulation", "seq_len",
              "precision", "optimizer", "steps")


class Grouped(Protocol):
    """Anything holding a group of runs (a figure's series)."""

    runs: list[Run]


def fmt_value(v: Any) -> str:
    """A parameter's value as labels and captions write it."""
    return f"{v:g}" if isinstance(v, float) else str(v)


def clock_of(runs: list[Run]) -> str:
    """The runs' clock: ``modelled``, ``measured`` or ``mixed``."""
    clocks = {r.clock for r in runs}
    return clocks.pop() if len(clocks) == 1 else "mixed"


def clock_caption(runs: list[Run]) -> str:
    """The sentence that says what a time axis measures."""
    c = clock_of(runs)
    text = ("Time is modelled for some runs and measured for others; each label says which." if c == "mixed"
            else f"Time axis: {CLOCK_TEXT.get(c, c)}.")
    busy = [r.name for r in runs if r.contended]
    if busy:
        text += (f" Contended (sharing cores with other processes; times may be inflated): {', '.join(busy)}"
                 f"{'' if len(busy) == len(runs) else ' (marked *)'}.")
    return text


def fixed_caption(col: Collection, skip: set[str] = frozenset()) -> str:
    """The sentence naming the parameters common to every run (except ``skip``)."""
    fixed = col.fixed()
    parts = [f"{k}={fmt_value(fixed[k])}" for k in FIXED_KEYS if k in fixed and k not in skip]
    return f"Fixed: {', '.join(parts)}." if parts else ""


def seed_note(groups: Iterable[Grouped]) -> str:
    """The sentence saying how many seeds each series averages ('' for one)."""
    n = max(len({str(r.value("seed")) for r in s.runs}) for s in groups)
    return f" Each series is the mean of {n} seeds (band/bars: min–max)." if n > 1 else ""
