"""Readiness of a testbed: every path carries traffic before :func:`gradzip.netem.testbed.up` returns.

Every host gets a permanent neighbour entry (IP -> MAC) for every other host, so no packet ever
waits on ARP: a datagram sent to an unresolved neighbour is queued, up to ``unres_qlen`` packets,
and the rest are dropped without an error to ``sendto``, and an ARP reply lost to the emulated
loss left a whole burst undelivered. Then a probe datagram must cross every ordered pair of hosts.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gradzip.errors import GradzipError

if TYPE_CHECKING:  # the testbed's record type; testbed imports this module
    from gradzip.netem.testbed import Testbed

CLONE_NEWNET = 0x40000000
HOST_IF = "eth0"
PROBE_TIMEOUT_S = 10.0  # how long `up` waits for a probe to cross every pair of hosts


class ReadinessError(GradzipError):
    """A path of the testbed carried nothing within the probe timeout."""


def fill_neighbours(tb: Testbed, run: Callable[..., object]) -> None:
    """A permanent neighbour entry on every host for every other host (one ``ip -batch`` per host):
    no ARP request is ever sent, so none can be lost and no first packet waits on resolution."""
    for i in range(tb.hosts):
        lines = [f"neigh replace {tb.host_addr(j)} lladdr {tb.host_mac(j)} dev {HOST_IF} nud permanent"
                 for j in range(tb.hosts) if j != i]
        if lines:
            run("ip", "-n", tb.host_ns(i), "-batch", "-", stdin="\n".join(lines) + "\n")


def _socket_in(ns: str) -> socket.socket:
    """A UDP socket created inside network namespace ``ns``. A socket keeps the namespace it was
    created in, so a short-lived thread enters the namespace (setns affects only the calling
    thread) and hands the socket back; this process's own namespace is never changed."""
    out: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            finally:
                os.close(fd)
            out.append(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            out.append(e)

    t = threading.Thread(target=make, name=f"netns-{ns}")
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise ReadinessError(f"cannot open a socket in namespace {ns}: {out[0]}")
    return out[0]


def host_socket(tb: Testbed, i: int) -> socket.socket:
    """A UDP socket inside host ``i``'s namespace, unbound (for users' own probes and tests)."""
    if not 0 <= i < tb.hosts:
        raise GradzipError(f"host {i} is not in testbed {tb.prefix!r} (hosts 0..{tb.hosts - 1})")
    return _socket_in(tb.host_ns(i))


def wait_until_ready(tb: Testbed, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Return once a UDP probe has crossed every ordered pair of hosts (i -> j for all i != j);
    probes are re-sent every 20 ms to the pairs still missing, so emulated loss only delays this.
    Raises NetemError naming the pairs that carried nothing within ``timeout_s``."""
    if tb.hosts < 2:
        return
    socks = [host_socket(tb, i) for i in range(tb.hosts)]
    try:
        for i, s in enumerate(socks):
            s.bind((tb.host_addr(i), 0))
            s.setblocking(False)
        ports = [s.getsockname()[1] for s in socks]
        index = {(tb.host_addr(i), ports[i]): i for i in range(tb.hosts)}
        missing = {(i, j) for i in range(tb.hosts) for j in range(tb.hosts) if i != j}
        deadline = time.monotonic() + timeout_s
        while missing and time.monotonic() < deadline:
            for i, j in missing:
                with contextlib.suppress(BlockingIOError):  # a full socket buffer: the next round re-sends
                    socks[i].sendto(b"gradzip-probe", (tb.host_addr(j), ports[j]))
            ready, _, _ = select.select(socks, [], [], 0.02)
            for s in ready:
                j = socks.index(s)
                with contextlib.suppress(BlockingIOError):
                    while True:
                        _, src = s.recvfrom(64)
                        if src in index:
                            missing.discard((index[src], j))
    finally:
        for s in socks:
            s.close()
    if missing:
        pairs = ", ".join(f"h{i}->h{j}" for i, j in sorted(missing)[:6]) + (" ..." if len(missing) > 6 else "")
        raise ReadinessError(f"testbed {tb.prefix!r}: no probe crossed {pairs} within {timeout_s:g} s "
                         f"(shaping {tb.shaping.describe()}); see `ip -n {tb.prefix}-h0 neigh` and `tc -s qdisc`")
