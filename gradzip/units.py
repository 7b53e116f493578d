"""Parsing of human units: bandwidths (``1gbit``), latencies (``50us``) and sizes (``25MB``).

Bandwidths are returned in bits per second, latencies in seconds, sizes in bytes.
"""

from __future__ import annotations

import re

from gradzip.errors import SpecError

_BW = {
    "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
    # byte-based spellings (capital B in the usual notation; we lower-case everything)
    "byte/s": 8.0, "kb/s": 8e3, "mb/s": 8e6, "gb/s": 8e9,
}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_SIZE = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_NUM = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"


def _parse(text: str | float | int, table: dict[str, float], what: str, default_unit: str) -> float:
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(_NUM + r"\s*([a-zµ/]*)", str(text).strip().lower())
        if not m:
            raise SpecError(
                f"cannot parse {what} {text!r}: expected a number and a unit, one of {', '.join(table)}"
            )
        unit = m.group(2) or default_unit
        if unit not in table:
            raise SpecError(f"unknown {what} unit {unit!r} in {text!r}: use one of {', '.join(table)}")
        value = float(m.group(1)) * table[unit]
    if value < 0:
        raise SpecError(f"{what} must not be negative, got {text!r}")
    return value


def parse_bandwidth(text: str | float) -> float:
    """``"1gbit"`` -> 1e9 bits/s. A bare number is bits/s. Must be > 0."""
    bw = _parse(text, _BW, "bandwidth", "bit")
    if bw <= 0:
        raise SpecError(f"bandwidth must be positive, got {text!r} (e.g. 1gbit, 100mbit)")
    return bw


def parse_latency(text: str | float) -> float:
    """``"50us"`` -> 5e-5 seconds. A bare number is seconds."""
    return _parse(text, _TIME, "latency", "s")


def parse_size(text: str | float) -> int:
    """``"25MB"`` -> 25_000_000 bytes. A bare number is bytes."""
    return int(_parse(text, _SIZE, "size", "b"))


def format_bandwidth(bps: float) -> str:
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"
