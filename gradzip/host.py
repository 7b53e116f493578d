"""This machine's cores and who else uses them: how many intra-op threads to give torch, and whether
a run shares its cores with other work (contention), which corrupts measured times.

- :func:`usable_cores`: the cores this process may run on (CPU affinity, and a cgroup CPU quota).
- :func:`busy_elsewhere`: how many cores other processes keep busy, from ``/proc/stat`` over a
  short window minus this process's own CPU time in it (``os.getloadavg`` where there is no
  ``/proc``).
- :func:`choose_threads`: ``OMP_NUM_THREADS`` when set; otherwise the cores actually free, at
  least 1. Torch's intra-op threads spin while they wait for each other, so a thread that shares
  its core with a neighbour slows every other one down (a 2-thread step on a 2-core machine with
  one busy core measured up to 5x its quiet time); one thread fewer costs far less.
- :class:`HostMonitor`: per step, the load other processes put on the machine and whether this
  run was contended: the others' load left fewer free cores than this run's threads, this process
  got clearly less CPU than it usually does, or its compute times spread far beyond their usual noise.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

CONTENDED_SHARE = 0.05  # a run is contended when more than this share of its steps were
LOAD_SLACK = 0.25  # others' busy cores beyond those this run leaves free: above this, contended
SPREAD_LIMIT = 1.5  # compute times of a step over the window's median: beyond this, contended
CPU_SHARE_LIMIT = 0.6  # CPU time over wall time × threads, against the run's usual: below this, contended


def is_contended(contended_steps: int, steps: int) -> bool:
    """A run whose time-based numbers may be off: over 5% of its steps shared their cores (one step
    that a short-lived process touched changes no mean)."""
    return steps > 0 and contended_steps > CONTENDED_SHARE * steps


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 ``cpu.max`` quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def _cpu_totals() -> tuple[float, float] | None:
    """(busy, total) jiffies of every core since boot, or None without ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def busy_elsewhere(window_s: float = 0.1) -> float:
    """Cores kept busy by other processes, measured over ``window_s`` (this process's own CPU time
    in the window is taken out). Without ``/proc/stat``: the 1-minute load average."""
    a, own0, t0 = _cpu_totals(), _own_cpu(), time.perf_counter()
    if a is None:
        return max(0.0, os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0.0
    time.sleep(window_s)
    b, own1, t1 = _cpu_totals(), _own_cpu(), time.perf_counter()
    assert b is not None
    cores = os.cpu_count() or 1
    if b[1] <= a[1]:
        return 0.0
    busy_cores = (b[0] - a[0]) / (b[1] - a[1]) * cores
    return max(0.0, busy_cores - (own1 - own0) / max(t1 - t0, 1e-9))


def choose_threads(busy: float | None = None) -> tuple[int, str]:
    """Torch's intra-op thread count and why: ``OMP_NUM_THREADS`` when set, else the free cores."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    cores = usable_cores()
    busy = busy_elsewhere() if busy is None else busy
    free = max(1, min(cores, math.floor(cores - busy + 0.5)))
    return free, f"{free} of {cores} cores free" if free < cores else f"all {cores} cores free"


@dataclass
class HostMonitor:
    """Contention, step by step. ``threads``: this run's intra-op threads. :meth:`start` before the
    first step; :meth:`step` after each, with the step's per-worker compute times (seconds). A step
    is *contended* when other processes kept more cores busy than this run left free
    (``host_load`` > cores − threads + 0.25), when this process got under 60% of the CPU share it
    usually gets (median of the last 20 steps), or when its compute time exceeded 1.5x the fastest
    of the last 20 steps."""

    threads: int
    cores: int = field(default_factory=usable_cores)
    computes: deque = field(default_factory=lambda: deque(maxlen=20))
    shares: deque = field(default_factory=lambda: deque(maxlen=20))
    loads: list[float] = field(default_factory=list)
    flags: list[bool] = field(default_factory=list)
    _last: tuple[float, float, tuple[float, float] | None] | None = None

    def start(self) -> None:
        self._last = (time.perf_counter(), _own_cpu(), _cpu_totals())

    def step(self, compute_s: list[float]) -> tuple[float, bool]:
        """(host_load, contended) of the step that just ended."""
        now, cpu, tot = time.perf_counter(), _own_cpu(), _cpu_totals()
        last, self._last = self._last, (now, cpu, tot)
        load, share = 0.0, 1.0
        if last is not None and now > last[0]:
            own = (cpu - last[1]) / (now - last[0])  # cores this process used
            share = own / self.threads
            if tot is not None and last[2] is not None and tot[1] > last[2][1]:
                busy = (tot[0] - last[2][0]) / (tot[1] - last[2][1]) * (os.cpu_count() or 1)
                load = max(0.0, busy - own)
            elif hasattr(os, "getloadavg"):
                load = max(0.0, os.getloadavg()[0] - own)
        spread = 1.0
        if compute_s:
            c = statistics.median(compute_s)
            if len(self.computes) >= 5:
                spread = c / max(min(self.computes), 1e-9)
            self.computes.append(c)
        # CPU share relative to this run's own usual share: serial Python parts leave threads idle anyway
        usual = statistics.median(self.shares) if len(self.shares) >= 5 else share
        self.shares.append(share)
        contended = (load > self.cores - self.threads + LOAD_SLACK or share < CPU_SHARE_LIMIT * usual
                     or spread > SPREAD_LIMIT)
        self.loads.append(round(load, 2))
        self.flags.append(bool(contended))
        return round(load, 2), bool(contended)

    def summary(self) -> dict[str, float | int | bool]:
        """``host_load`` (mean and max over the steps), how many steps were contended, and whether the
        run was (:func:`is_contended`)."""
        n = len(self.flags)
        return {"host_load": round(sum(self.loads) / n, 2) if n else 0.0,
                "host_load_max": max(self.loads, default=0.0),
                "contended_steps": sum(self.flags), "contended": is_contended(sum(self.flags), n)}
