"""What a testbed is asked for: :class:`Shaping` (rate, delay, loss of every host's egress) and the
``--netem`` spelling ``HOSTS:RATE[:DELAY[:LOSS%]]`` (:func:`parse_netem`). Plain values, no system calls."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gradzip.errors import GradzipError
from gradzip.units import format_bandwidth, parse_bandwidth, parse_latency


@dataclass(frozen=True)
class Shaping:
    """Egress shaping of every host: rate in bits/s, one-way added delay in seconds, loss in %."""

    rate_bps: float
    delay_s: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if not self.rate_bps > 0:
            raise GradzipError(f"rate must be positive, got {self.rate_bps} bit/s (e.g. 100mbit)")
        if self.delay_s < 0 or self.delay_s > 10:
            raise GradzipError(f"delay must be between 0 and 10 s, got {self.delay_s} s")
        if not 0 <= self.loss_pct < 100:
            raise GradzipError(f"loss must be a percentage in [0, 100), got {self.loss_pct}")

    def describe(self) -> str:
        s = format_bandwidth(self.rate_bps)
        if self.delay_s:
            s += f", delay {self.delay_s * 1e3:g} ms"
        if self.loss_pct:
            s += f", loss {self.loss_pct:g}%"
        return s


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


SPEC_HELP = "HOSTS:RATE[:DELAY[:LOSS%]], e.g. 4:100mbit or 4:1gbit:0.1ms:0.01"


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
        rate = parse_bandwidth(parts[1])
        delay = parse_latency(parts[2]) if len(parts) > 2 else 0.0
    except GradzipError as e:
        raise GradzipError(f"--netem: {e}") from None
    loss = parse_loss(parts[3]) if len(parts) > 3 else 0.0
    return NetemSpec(hosts, Shaping(rate, delay, loss), str(text).strip())
