"""What a testbed is asked for: :class:`Shaping` (rate, delay, loss of every host's egress) and the
``--netem`` spelling ``HOSTS:RATE[:DELAY[:LOSS%]]`` (:func:`parse_netem`). Plain values, no system calls.

A rate is a bandwidth (``100mbit``, ``1gbit``; :func:`gradzip.units.parse_bandwidth`) or ``unshaped``
(:func:`parse_rate`): no rate limit at all, the veth pairs at the speed of the kernel's copies
(``rate_bps`` is None; no delay or loss, which ride on the shaped classes)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gradzip.errors import GradzipError
from gradzip.units import format_bandwidth, parse_bandwidth, parse_latency

UNSHAPED = "unshaped"  # the rate of a link without rate limit

@dataclass(frozen=True)
class Shaping:
    """Egress shaping of every host: rate in bits/s, one-way added delay in seconds, loss in %."""

    rate_bps: float | None  # None: unshaped (no rate limit)
    delay_s: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_bps is None:
            if self.delay_s or self.loss_pct:
                raise GradzipError(f"an {UNSHAPED} link takes no delay or loss (they are emulated on the shaped "
                                   "classes); give a rate, e.g. 10gbit")
        elif not self.rate_bps > 0:
            raise GradzipError(f"rate must be positive, got {self.rate_bps} bit/s (e.g. 100mbit)")
        if self.delay_s < 0 or self.delay_s > 10:
            raise GradzipError(f"delay must be between 0 and 10 s, got {self.delay_s} s")
        if not 0 <= self.loss_pct < 100:
            raise GradzipError(f"loss must be a percentage in [0, 100), got {self.loss_pct}")

    @property
    def unshaped(self) -> bool:
        return self.rate_bps is None

    @property
    def rate_text(self) -> str:
        """``"100 Mbit/s"``, or ``"unshaped"``."""
        return UNSHAPED if self.rate_bps is None else format_bandwidth(self.rate_bps)

    def describe(self) -> str:
        s = self.rate_text
        if self.delay_s:
            s += f", delay {self.delay_s * 1e3:g} ms"
        if self.loss_pct:
            s += f", loss {self.loss_pct:g}%"
        return s


def parse_rate(text: str | float) -> float | None:
    """A link rate: ``"100mbit"`` -> 1e8 bits/s, or ``"unshaped"`` (any case) -> None (no limit)."""
    if isinstance(text, str) and text.strip().lower() == UNSHAPED:
        return None
    return parse_bandwidth(text)


def parse_loss(text: str | float) -> float:
    """``"0.5%"`` or ``"0.5"`` -> 0.5 (percent of packets)."""
    raw = str(text).strip().rstrip("%")
    try:
        v = float(raw)
    except ValueError:
        raise GradzipError(f"cannot parse loss {text!r}: give a percentage, e.g. 0.1 or 0.1%") from None
    if not 0 <= v < 100:
        raise GradzipError(f"loss must be a percentage in [0, 100), got {text!r}")
    return v


SPEC_HELP = "HOSTS:RATE[:DELAY[:LOSS%]], e.g. 4:100mbit, 4:1gbit:0.1ms:0.01 or 2:unshaped"


@dataclass(frozen=True)
class NetemSpec:
    hosts: int
    shaping: Shaping
    text: str


def parse_netem(text: str) -> NetemSpec:
    """``"4:100mbit:0.1ms:0.5"`` -> 4 hosts, 100 Mbit/s, 0.1 ms delay, 0.5 % loss."""
    parts = str(text).strip().split(":")
    if not 2 <= len(parts) <= 4 or not re.fullmatch(r"\d+", parts[0]):
        raise GradzipError(f"--netem must look like {SPEC_HELP}, got {text!r}")
    hosts = int(parts[0])
    if not 1 <= hosts <= 250:
        raise GradzipError(f"--netem: HOSTS must be between 1 and 250, got {hosts}")
    try:
        rate = parse_rate(parts[1])
        delay = parse_latency(parts[2]) if len(parts) > 2 else 0.0
    except GradzipError as e:
        raise GradzipError(f"--netem: {e}") from None
    loss = parse_loss(parts[3]) if len(parts) > 3 else 0.0
    try:
        shaping = Shaping(rate, delay, loss)
    except GradzipError as e:
        raise GradzipError(f"--netem: {e}") from None
    return NetemSpec(hosts, shaping, str(text).strip())
