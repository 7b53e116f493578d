"""The control channel of an ``mpi`` communicator: how a rank learns, when a collective fails or
times out, which peers are dead or hung and which are alive but behind.

Every rank answers pings on its own control communicator (from the progress thread and from every
wait) with how many collectives it has launched and which one it is waiting in;
:meth:`PingChannel.diagnose` pings every peer for a few seconds and says who did not answer and
who has not reached the collective. A communicator other than ``MPI_COMM_WORLD`` names
``MPI_COMM_WORLD``'s (global) ranks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

TAG_PING = 7001
TAG_PONG = 7100  # + probe id % 10000


def rank_name(r: int, glob: list[int] | None) -> str:
    """Rank ``r`` for messages; ``glob``: the global rank of each rank (None: they are global)."""
    return f"rank {r}" if glob is None else f"global rank {glob[r]}"


def ranks_name(rs: list[int], glob: list[int] | None) -> str:
    return f"rank(s) {rs}" if glob is None else f"global rank(s) {[glob[r] for r in rs]}"


class PingChannel:
    """Pings and answers on ``ctl`` (a communicator of its own, so that no data traffic delays
    them); ``glob`` names ranks as :func:`rank_name` does."""

    def __init__(self, MPI: Any, ctl: Any, glob: list[int] | None) -> None:
        self.MPI, self._ctl, self._glob = MPI, ctl, glob
        self._lock = threading.Lock()
        self._pongs: list[Any] = []
        self._probe_id = 0
        self._probe_bufs: Any = None

    def answer(self, launched: int, waiting: int) -> None:
        """Answer every ping received: this rank has launched ``launched`` collectives and waits
        in collective ``waiting`` (-1: none)."""
        MPI = self.MPI
        with self._lock:
            while True:
                status = MPI.Status()
                msg = self._ctl.Improbe(MPI.ANY_SOURCE, TAG_PING, status)
                if msg is None:
                    break
                ping = np.empty(1, dtype=np.int64)
                msg.Recv(ping)
                pong = np.array([ping[0], launched, waiting], dtype=np.int64)
                self._pongs.append((self._ctl.Isend(pong, dest=status.Get_source(),
                                                    tag=TAG_PONG + int(ping[0]) % 10000), pong))
            self._pongs = [(r, b) for r, b in self._pongs if not r.Test()]

    def diagnose(self, seq: int, seconds: float, answer: Callable[[], None]) -> str:
        """Ping every peer for ``seconds``; say who did not answer and who is behind collective
        ``seq``. ``answer()`` answers this rank's own pings meanwhile."""
        MPI = self.MPI
        self._probe_id += 1
        probe = self._probe_id
        me, n = self._ctl.Get_rank(), self._ctl.Get_size()
        peers = [p for p in range(n) if p != me]
        ping = np.array([probe], dtype=np.int64)
        sends = [self._ctl.Isend(ping, dest=p, tag=TAG_PING) for p in peers]
        bufs = {p: np.zeros(3, dtype=np.int64) for p in peers}
        recvs = {p: self._ctl.Irecv(bufs[p], source=p, tag=TAG_PONG + probe % 10000) for p in peers}
        answered: dict[int, tuple[int, int]] = {}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and len(answered) < len(peers):
            for p, r in recvs.items():
                if p not in answered and r.Test():
                    answered[p] = (int(bufs[p][1]), int(bufs[p][2]))
            answer()
            time.sleep(0.005)
        for p, r in list(recvs.items()) + list(zip(peers, sends)):
            if p not in answered:
                try:
                    r.Cancel()
                except MPI.Exception:
                    pass
        self._probe_bufs = (ping, bufs, sends, recvs)  # cancelled requests may still refer to them
        silent = [p for p in peers if p not in answered]
        behind = {p: v for p, v in answered.items() if v[0] <= seq}
        parts = []
        if silent:
            parts.append(f"{ranks_name(silent, self._glob)} not responding for {seconds:g} s (dead or hung)")
        if behind:
            names = {p: rank_name(p, self._glob) for p in behind}
            parts.append("alive but not at this collective yet: " + ", ".join(
                (f"{names[p]} (last launched #{k - 1}" if k else f"{names[p]} (launched none")
                + (f", waiting in #{w})" if w >= 0 else ")") for p, (k, w) in behind.items()))
        return "; ".join(parts) or "every rank responds and has launched it: the network or MPI library is stuck"
