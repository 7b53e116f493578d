"""Progress output that suits where it goes: a tqdm bar on a terminal, plain lines anywhere else.

A bar redraws itself with ``\\r`` many times a second; written into a log file (a Slurm job, a
sweep's ``logs/``, a pipe) that is about a thousand overwritten updates per bar. When the stream is
not a terminal, :func:`progress_bar` returns a :class:`PlainProgress` instead, which prints one
ordinary line every 10% of the total or every 30 s, whichever comes first, and a last one at the end.
Both take the same calls (iterate, ``update``, ``set_postfix``, ``close``); a disabled one prints
nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

from tqdm import tqdm

EVERY_FRACTION = 0.1  # a plain line at every 10% of the total ...
EVERY_S = 30.0  # ... or after this many seconds without one, whichever comes first


def is_terminal(stream: IO[str] | None) -> bool:
    """Whether ``stream`` is an interactive terminal (False for files, pipes and closed streams)."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class PlainProgress:
    """Progress as plain lines (no ``\\r``): ``desc: n/total unit (p%), elapsed, rate, postfix``."""

    def __init__(self, iterable: Iterable[Any] | None = None, total: float | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, file: IO[str] | None = None,
                 every_s: float = EVERY_S, **_ignored: Any) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n = self.printed = self.initial = initial
        self.file = file if file is not None else sys.stderr
        self.every_s = every_s
        self.postfix = ""
        self.start = self.last = time.monotonic()
        self.step = max(1.0, (total - initial) * EVERY_FRACTION) if total else 0.0
        self.closed = False

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_postfix(self, values: dict[str, Any] | None = None, refresh: bool = False, **kw: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in {**(values or {}), **kw}.items())

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if (self.step and self.n - self.printed >= self.step) or now - self.last >= self.every_s:
            self._line(now)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.n != self.printed:
                self._line(time.monotonic())

    def _line(self, now: float) -> None:
        elapsed = now - self.start
        done = f"{self.n:,.0f}/{self.total:,.0f} {self.unit} ({100 * self.n / self.total:.0f}%)" if self.total \
            else f"{self.n:,.0f} {self.unit}"
        rate = f"{(self.n - self.initial) / elapsed:,.1f} {self.unit}/s" if elapsed > 0 else ""
        parts = [f"{self.desc}: {done}" if self.desc else done, f"{elapsed:.0f}s", rate, self.postfix]
        print(", ".join(p for p in parts if p), file=self.file, flush=True)
        self.printed, self.last = self.n, now


def progress_bar(iterable: Iterable[Any] | None = None, *, disable: bool = False, file: IO[str] | None = None,
                 **kw: Any) -> Any:
    """A tqdm bar when ``file`` (default ``sys.stderr``) is a terminal, else a :class:`PlainProgress`
    taking the same arguments (``total``, ``desc``, ``unit``, ``initial``); disabled: silent."""
    stream = file if file is not None else sys.stderr
    if disable or is_terminal(stream):
        return tqdm(iterable, disable=disable, file=stream, **kw)
    return PlainProgress(iterable, file=stream, **kw)
