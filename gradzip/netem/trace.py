"""``gradzip netem reshape --trace FILE``: a link whose rate changes over time, while a run goes on.

A trace is a text file of rows ``time, rate[, delay[, loss]]`` (comma- or white-space-separated;
``#`` starts a comment; a header row naming the columns is skipped)::

    # time_s  rate
    0         10gbit
    30        100mbit
    60        10gbit

``time`` is seconds from the start of playback (increasing, the first 0); ``rate``, ``delay`` and
``loss`` are spelled as for ``gradzip netem up``. Playback applies each row's shaping at its time
(:func:`gradzip.netem.testbed.reshape`, every host at once), then, with ``--repeat``, starts over
after ``--period`` seconds (default: the last row's time plus the gap before it). Every change is
appended to ``--log`` (JSON lines: ``t`` seconds since playback began, ``unix`` time, ``rate_bps``,
``delay_s``, ``loss_pct``, and ``applied_s``, how long ``tc`` took), the link-rate series that
``gradzip plot`` draws under a run's decisions. Playback runs in the foreground until the trace
ends (or, with ``--repeat``, until interrupted); start it in the background beside the run.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gradzip.errors import GradzipError, SpecError
from gradzip.netem.spec import Shaping, parse_loss
from gradzip.units import parse_bandwidth, parse_latency


@dataclass(frozen=True)
class TracePoint:
    t: float
    shaping: Shaping


def parse_trace(text: str, source: str = "trace") -> list[TracePoint]:
    """The rows of a trace; a bad row is a one-line error naming the file, the line and the fix."""
    points: list[TracePoint] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        cols = [c for c in re.split(r"[,\s]+", line) if c]
        if not points and not _is_number(cols[0]):  # a header row
            continue
        where = f"{source}:{n}"
        if not 2 <= len(cols) <= 4:
            raise GradzipError(f"{where}: expected 'time, rate[, delay[, loss]]', got {line!r}")
        if not _is_number(cols[0]) or float(cols[0]) < 0:
            raise GradzipError(f"{where}: time must be seconds >= 0, got {cols[0]!r}")
        t = float(cols[0])
        if points and t <= points[-1].t:
            raise GradzipError(f"{where}: times must increase ({t:g} s after {points[-1].t:g} s)")
        if not points and t != 0:
            raise GradzipError(f"{where}: the first row must be at time 0 (the shaping playback starts with), "
                               f"got {t:g}")
        try:
            shaping = Shaping(parse_bandwidth(cols[1]), parse_latency(cols[2]) if len(cols) > 2 else 0.0,
                              parse_loss(cols[3]) if len(cols) > 3 else 0.0)
        except (SpecError, GradzipError, ValueError) as e:
            raise GradzipError(f"{where}: {str(e).splitlines()[0]}") from None
        points.append(TracePoint(t, shaping))
    if not points:
        raise GradzipError(f"{source}: no rows; write 'time, rate' rows, e.g. '0, 10gbit' and '30, 100mbit'")
    return points


def read_trace(path: str | Path) -> list[TracePoint]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise GradzipError(f"--trace {p}: cannot read it ({e.strerror or type(e).__name__})") from None
    return parse_trace(text, str(p))


def default_period(points: list[TracePoint]) -> float:
    """One pass of the trace: the last row's time plus the gap before it (one row: 60 s)."""
    if len(points) == 1:
        return 60.0
    return points[-1].t + (points[-1].t - points[-2].t)


def schedule(points: list[TracePoint], repeat: bool, period: float) -> Iterator[TracePoint]:
    """The rows in playback order, with their times shifted by ``period`` on every pass."""
    k = 0
    while True:
        for p in points:
            yield TracePoint(p.t + k * period, p.shaping)
        if not repeat:
            return
        k += 1


def play(points: list[TracePoint], apply: Callable[[Shaping], None], log: Path | None = None,
         repeat: bool = False, period: float | None = None, clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], None] = time.sleep) -> int:
    """Apply each row at its time (``apply``: the testbed's reshape); returns the rows applied."""
    period = default_period(points) if period is None else period
    if repeat and period <= points[-1].t:
        raise GradzipError(f"--period {period:g} s must be longer than the trace's last time {points[-1].t:g} s")
    start, done = clock(), 0
    for p in schedule(points, repeat, period):
        wait = start + p.t - clock()
        if wait > 0:
            sleep(wait)
        t0 = clock()
        apply(p.shaping)
        applied = clock() - t0
        done += 1
        if log is not None:
            rec = {"t": round(t0 - start, 6), "unix": time.time(), "rate_bps": p.shaping.rate_bps,
                   "delay_s": p.shaping.delay_s, "loss_pct": p.shaping.loss_pct, "applied_s": round(applied, 6)}
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
    return done


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
