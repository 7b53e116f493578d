"""Modelled time to a target loss at other link bandwidths than a run's own (``[target] bandwidths``).

A run was clocked at bandwidth ``B0`` (its ``bandwidth``; the ``sim`` backend's modelled link, or
the testbed's emulated one). To ask "when would it have reached the target on a link of bandwidth
``B``?", each step is re-timed with a first-order model:

- the step's exposed communication at ``B`` is ``max(0, comm_s + bits · (1/B − 1/B0))`` with
  ``bits = 8 · bytes`` the bits this rank put on the link that step: the link time of its bytes
  scales with the bandwidth, while the overlap window (what backward hid) and the latency terms
  stay what they were. ``bytes`` is ``bytes_inter`` (the bytes that crossed between nodes, which
  is all of ``bytes_sent`` unless ranks share a node) when the row has it, else ``bytes_sent``;
- the step's time at ``B`` is ``compute_s + compress_s + opt_s`` plus that exposed communication;
- the time at ``B`` after step ``k`` is the sum over steps ``1..k``. It is computed as the run's
  own cumulative ``wall_s`` plus the sum of the changes of ``comm_s``, which is the same number
  when ``step_s = compute_s + compress_s + comm_s + opt_s`` (the ``sim`` clock) and keeps
  whatever else a measured clock holds; at ``B = B0`` it is exactly the run's ``wall_s``.

The step where the target is reached does not depend on ``B`` (the same step is taken, only its
duration changes): it is the step of the time-to-target column, :meth:`Run.target_index
<gradzip.plots.results.Run.target_index>`. A step between two syncs of ``--sync diloco`` sends
nothing and keeps its time; a sync step's time grows with its bytes, so a run that sends less
gains more from a slow link. What the model leaves out: a slower link could stretch the overlap
a backward pass offers (it does not: the window is fixed), and congestion or a different
collective algorithm at ``B`` (the bytes are those of the run).

A run without a bandwidth, or whose rows lack ``comm_s`` and the bytes, cannot be re-timed
(None: ``—`` in the table).
"""

from __future__ import annotations

from typing import Any

from gradzip.errors import SpecError
from gradzip.plots.results import LossTarget, Run
from gradzip.units import format_bandwidth, parse_bandwidth

BITS_PER_BYTE = 8


def bandwidth_columns(bandwidths: list[Any]) -> list[tuple[str, float]]:
    """``["100mbit", "1gbit"]`` -> ``[("time_to_target_100mbit_s", 1e8), ("time_to_target_1gbit_s", 1e9)]``.

    Raises :class:`SpecError` (one line) for a value :func:`gradzip.units.parse_bandwidth` rejects
    or for two values that are the same bandwidth (``100mbit`` and ``100Mb/s``).
    """
    out: list[tuple[str, float]] = []
    seen: dict[float, Any] = {}
    for b in bandwidths:
        if isinstance(b, bool) or not isinstance(b, (str, int, float)):
            raise SpecError(f"bandwidth {b!r} must be a string such as \"100mbit\" or a number of bits/s")
        bps = parse_bandwidth(b)
        if bps in seen:
            raise SpecError(f"bandwidths {seen[bps]!r} and {b!r} are the same bandwidth; give it once")
        seen[bps] = b
        out.append((column_name(bps), bps))
    return out


def column_name(bps: float) -> str:
    """The results-table column of the modelled time to target at ``bps`` bits/s."""
    return f"time_to_target_{format_bandwidth(bps)}_s"


def step_bits(row: dict[str, Any]) -> float | None:
    """Bits this rank put on the modelled link in a metrics row (see the module doc), or None."""
    b = row.get("bytes_inter")
    if b is None:
        b = row.get("bytes_sent")
    return None if b is None else float(b) * BITS_PER_BYTE


def retimed_comm(comm_s: float, bits: float, bps: float, bps0: float) -> float:
    """Exposed communication of one step at ``bps`` of a step that had ``comm_s`` at ``bps0``."""
    return max(0.0, comm_s + bits * (1.0 / bps - 1.0 / bps0))


def retimed_wall(run: Run, bps: float) -> list[float] | None:
    """Cumulative modelled time (s) at ``bps`` after each row of ``run.metrics`` (None: cannot be
    re-timed, see the module doc). Rows without a ``step`` take no time."""
    bps0 = run.bandwidth_bps
    if bps0 is None:
        return None
    out: list[float] = []
    shift = 0.0
    for m in run.metrics:
        if m.get("step") is not None:
            bits = step_bits(m)
            if m.get("comm_s") is None or bits is None:
                return None
            comm = float(m["comm_s"])
            shift += retimed_comm(comm, bits, bps, bps0) - comm
        out.append(float(m.get("wall_s", 0.0)) + shift)
    return out


def time_to_target_at(run: Run, target: LossTarget, bps: float) -> float | None:
    """Modelled seconds until ``target`` is first reached if the run's link had ``bps`` bits/s
    (None: never reached, or the run cannot be re-timed)."""
    i = run.target_index(target)
    if i is None:
        return None
    clock = retimed_wall(run, bps)
    return None if clock is None else clock[i]
