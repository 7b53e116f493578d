"""Parsing of human units: bandwidths (``1gbit``), latencies (``50us``), durations (``5min``) and
sizes (``25MB``).

Bandwidths are returned in bits per second, latencies and durations in seconds, sizes in bytes.
"""

from __future__ import annotations

import re

from gradzip.errors import SpecError

# Bandwidth prefixes; the unit's case decides bits (b) or bytes (B) after the prefix, as usual:
# "100Mbit", "100Mb/s", "100mbps" are bits; "12.5MB/s", "12.5MBps" are bytes (8 bits).
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_DURATION = {**_TIME, "min": 60.0, "h": 3600.0}
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
    """``"1gbit"`` -> 1e9 bits/s. Units: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` (any case),
    ``Mb/s``/``Mbps`` (bits) and ``MB/s``/``MBps`` (bytes). A bare number is bits/s. Must be > 0."""
    if isinstance(text, (int, float)):
        bw = float(text)
    elif str(text).strip().startswith("-"):
        raise SpecError(f"bandwidth must be positive, got {text!r} (e.g. 1gbit, 100mbit)")
    else:
        m = re.fullmatch(_NUM + r"\s*([a-zA-Z/]*)", str(text).strip())
        if not m:
            raise SpecError(f"cannot parse bandwidth {text!r}: expected a number and a unit such as 1gbit, "
                            "100mbit, 10Gb/s or 125MB/s")
        unit = m.group(2)
        low = unit.lower()
        if low.endswith("bit"):
            prefix, scale = low[:-3], 1.0
        elif low.endswith(("b/s", "bps")):
            prefix, scale = low[:-3], (8.0 if unit[-3] == "B" else 1.0)
        elif unit == "":
            prefix, scale = "", 1.0
        else:
            prefix, scale = "?", 1.0
        if prefix not in _PREFIX:
            raise SpecError(f"unknown bandwidth unit {unit!r} in {text!r}: use bit, kbit, mbit, gbit or tbit "
                            "(or Mb/s, Gbps for bits; MB/s, GBps for bytes)")
        bw = float(m.group(1)) * _PREFIX[prefix] * scale
    if bw <= 0:
        raise SpecError(f"bandwidth must be positive, got {text!r} (e.g. 1gbit, 100mbit)")
    return bw


def parse_latency(text: str | float) -> float:
    """``"50us"`` -> 5e-5 seconds. A bare number is seconds."""
    return _parse(text, _TIME, "latency", "s")


def parse_duration(text: str | float) -> float:
    """``"5min"`` -> 300 seconds (units ``ns``, ``us``, ``ms``, ``s``, ``min``, ``h``). A bare
    number is seconds; must not be negative."""
    return _parse(text, _DURATION, "duration", "s")


def parse_size(text: str | float) -> int:
    """``"25MB"`` -> 25_000_000 bytes. A bare number is bytes."""
    return int(_parse(text, _SIZE, "size", "b"))


def format_bandwidth(bps: float) -> str:
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"
