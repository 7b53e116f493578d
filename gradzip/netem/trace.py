"""A link whose rate changes over time, while a run goes on: ``gradzip netem reshape --trace FILE``
and ``gradzip train --netem ... --netem-trace FILE`` (both through :func:`read_trace` and :func:`play`).

A trace is a text file of rows ``time, rate[, delay[, loss]]`` (comma- or white-space-separated;
``#`` starts a comment; a header row naming the columns is skipped)::

    # time_s  rate
    0         10gbit
    30        100mbit
    60        10gbit

``time`` is seconds from the start of playback (increasing, the first 0); ``rate``, ``delay`` and
``loss`` are spelled as for ``gradzip netem up`` (``unshaped``: no rate limit). Playback applies
each row's shaping at its time (:func:`gradzip.netem.testbed.reshape`, every host at once), then,
with ``repeat``, starts over after ``period`` seconds (default: the last row's time plus the gap
before it). Every change is logged (``--log``; ``link.jsonl`` of a ``gradzip train`` run) as a
JSON line: ``t`` seconds since playback began, ``unix`` time, ``rate_bps`` (null: unshaped),
``rate`` (as text), ``delay_s``, ``loss_pct``, ``applied_s`` (how long ``tc`` took), and, from
``gradzip train``, ``step``: the optimizer steps the run had logged when the change was applied.
``gradzip plot --figures policy`` draws that series under a run's decisions.

A FILE that does not exist is looked up among the traces shipped in ``gradzip/netem/traces/``
by name (:func:`resolve_trace`), e.g. ``10gbit-100mbit-30s``: 10 Gbit/s for 30 s, then 100 Mbit/s for
30 s. ``reshape --trace`` plays in the foreground until the trace ends (or, with ``--repeat``,
until interrupted); ``gradzip train`` plays it in a thread (:class:`Playback`) from the launch of
the ranks until they exit, repeating.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradzip.errors import GradzipError, SpecError
from gradzip.netem.spec import Shaping, parse_loss, parse_rate
from gradzip.units import parse_latency

SHIPPED = Path(__file__).resolve().parent / "traces"  # shipped traces: NAME.txt
Sink = Callable[[dict[str, Any]], None]


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
            shaping = Shaping(parse_rate(cols[1]), parse_latency(cols[2]) if len(cols) > 2 else 0.0,
                              parse_loss(cols[3]) if len(cols) > 3 else 0.0)
        except (SpecError, GradzipError, ValueError) as e:
            raise GradzipError(f"{where}: {str(e).splitlines()[0]}") from None
        points.append(TracePoint(t, shaping))
    if not points:
        raise GradzipError(f"{source}: no rows; write 'time, rate' rows, e.g. '0, 10gbit' and '30, 100mbit'")
    return points


def shipped_traces() -> dict[str, Path]:
    """The traces that ship with gradzip, by name (the file's stem)."""
    return {p.stem: p for p in sorted(SHIPPED.glob("*.txt"))}


def resolve_trace(text: str | Path, base: str | Path | None = None, flag: str = "--trace") -> Path:
    """The file a trace argument names: a path (a relative one from ``base``, default the working
    directory) if that file exists, else the shipped trace of that name (``NAME`` or ``NAME.txt``).
    Neither: a one-line error listing the shipped names."""
    raw = Path(text).expanduser()
    path = raw if raw.is_absolute() or base is None else Path(base) / raw
    if path.is_file():
        return path
    shipped = shipped_traces()
    name = raw.name[:-4] if raw.name.endswith(".txt") else raw.name
    if len(raw.parts) == 1 and name in shipped:
        return shipped[name]
    where = f" (relative to {base})" if base is not None and not raw.is_absolute() else ""
    raise GradzipError(f"{flag} {text}: no such file{where}, nor a shipped trace of that name; shipped: "
                       f"{', '.join(shipped) or '(none)'}")


def read_trace(path: str | Path, flag: str = "--trace") -> list[TracePoint]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or type(e).__name__
        raise GradzipError(f"{flag} {p}: cannot read it ({why})") from None
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


def jsonl_sink(path: str | Path) -> Sink:
    """A log that appends each record to ``path`` as a JSON line."""
    def write(rec: dict[str, Any]) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
    return write


def change_record(shaping: Shaping, t: float, applied: float) -> dict[str, Any]:
    """One logged change (the fields of the module docstring, but ``step``)."""
    return {"t": round(t, 6), "unix": time.time(), "rate_bps": shaping.rate_bps, "rate": shaping.rate_text,
            "delay_s": shaping.delay_s, "loss_pct": shaping.loss_pct, "applied_s": round(applied, 6)}


def play(points: list[TracePoint], apply: Callable[[Shaping], None], log: Path | Sink | None = None,
         repeat: bool = False, period: float | None = None, clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], Any] = time.sleep, stop: threading.Event | None = None) -> int:
    """Apply each row at its time (``apply``: the testbed's reshape); returns the rows applied.
    ``log``: a JSON-lines file or a callable taking each change's record. ``stop``: once set, no
    further row is applied (a wait in progress ends at once when ``sleep`` is ``stop.wait``)."""
    period = default_period(points) if period is None else period
    if repeat and period <= points[-1].t:
        raise GradzipError(f"--period {period:g} s must be longer than the trace's last time {points[-1].t:g} s")
    sink = jsonl_sink(log) if isinstance(log, (str, Path)) else log
    start, done = clock(), 0
    for p in schedule(points, repeat, period):
        wait = start + p.t - clock()
        if wait > 0:
            sleep(wait)
        if stop is not None and stop.is_set():
            break
        t0 = clock()
        apply(p.shaping)
        done += 1
        if sink is not None:
            sink(change_record(p.shaping, t0 - start, clock() - t0))
    return done


class Playback:
    """``with Playback(points, apply, log):`` plays the trace in a thread, repeating it (when it has
    more than one row) until the block ends; the exit stops it and waits for a change in progress
    to finish, so whatever restores the link afterwards has the last word. A failure to apply a
    row is reported on stderr once and ends playback; the run goes on."""

    def __init__(self, points: list[TracePoint], apply: Callable[[Shaping], None], log: Path | Sink | None = None,
                 period: float | None = None, name: str = "trace") -> None:
        self.points, self.apply, self.log, self.period, self.name = points, apply, log, period, name
        self.stop = threading.Event()
        self.applied = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"gradzip-netem-{name}", daemon=True)

    def _run(self) -> None:
        try:
            self.applied = play(self.points, self.apply, self.log, repeat=len(self.points) > 1, period=self.period,
                                sleep=self.stop.wait, stop=self.stop)
        except Exception as e:  # noqa: BLE001 - reported, not raised: the run goes on at the last rate
            self.error = e
            sys.stderr.write(f"gradzip netem: {self.name}: playback stopped: {str(e).splitlines()[0]}\n")

    def __enter__(self) -> Playback:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(timeout=60)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
