"""Liveness and progress of the ranks of a ``torch`` communicator, through the rendezvous store.

Every rank of a communicator runs a :class:`Heartbeat` thread that writes ``beat, collectives
launched, state`` under ``gradzip_hb/<instance>/<rank>`` every ``interval`` s. ``instance`` must be
the same string on every rank of the communicator and differ between communicators: top-level
communicators are numbered in creation order (the same on every rank), sub-communicators derive
theirs from their parent's, the parent's split count and the colour (see
``TorchCommunicator.split``). When a collective fails, :meth:`Heartbeat.diagnose` watches the
others' heartbeats and says who is lost, who failed themselves and who is behind.

Ranks in the text: a top-level communicator's ranks are the global ranks and are written
``rank(s) [..]``; a sub-communicator (``global_ranks`` given) names every rank by its **global**
rank, written ``global rank(s) [..]``, so that the message means the same on every rank and in
the launcher's logs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

HB_PREFIX = "gradzip_hb/"


class Heartbeat:
    """One rank's heartbeat in one communicator. ``rank``/``world_size`` are the communicator's;
    ``global_ranks[r]`` is the global rank of its rank ``r`` (None: they are the global ranks);
    ``store_host`` is the *global* rank whose process serves the store (None: torchrun's agent)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, progress: Callable[[], int],
                 interval: float = 0.25, store_host: int | None = 0, instance: int | str = 0,
                 global_ranks: list[int] | None = None) -> None:
        self.store, self.rank, self.n = store, rank, world_size
        self.instance = str(instance)
        self.progress = progress  # () -> collectives launched so far
        self.interval = interval
        self.store_host = store_host
        self.global_ranks = global_ranks
        self.state = "ok"
        self._beat = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._paused = False  # tests: simulate a hung rank
        self._write()  # synchronously, so that every key exists after the init barrier
        self._thread = threading.Thread(target=self._run, name=f"gradzip-heartbeat-{self.instance}-{rank}",
                                        daemon=True)
        self._thread.start()

    # -- naming -----------------------------------------------------------------------
    def _g(self, r: int) -> int:
        return r if self.global_ranks is None else self.global_ranks[r]

    def _many(self, rs: list[int]) -> str:
        prefix = "rank(s)" if self.global_ranks is None else "global rank(s)"
        return f"{prefix} {[self._g(r) for r in rs]}"

    def _one(self, r: int) -> str:
        return f"rank {r}" if self.global_ranks is None else f"global rank {self._g(r)}"

    def _host(self) -> str:
        return f"rank {self.store_host}" if self.global_ranks is None else f"global rank {self.store_host}"

    # -- beating ----------------------------------------------------------------------
    def _key(self, r: int) -> str:
        return f"{HB_PREFIX}{self.instance}/{r}"

    def _write(self) -> None:
        with self._lock:
            self._beat += 1
            self.store.set(self._key(self.rank), f"{self._beat} {self.progress()} {self.state}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self._paused:
                continue
            try:
                self._write()
            except Exception:  # store gone (its host exited): nothing left to tell
                return

    def pause(self) -> None:
        """Stop beating but keep the thread (tests use it to simulate a hung rank)."""
        self._paused = True

    def set_state(self, state: str) -> None:
        self.state = state
        try:
            self._write()
        except Exception:
            pass

    def stop(self, state: str = "closed") -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.set_state(state)

    def linger(self, seconds: float, until_all_stopped: bool) -> None:
        """Keep the store (served by this process) up for the others: until every other rank has
        stopped its heartbeat (``until_all_stopped``), or for ``seconds`` (they are diagnosing)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if until_all_stopped:
                cur = self._read()
                if cur is None or all(cur[r][2] != "ok" for r in range(self.n) if r != self.rank):
                    return
            time.sleep(self.interval / 5)

    def _read(self) -> dict[int, tuple[int, int, str]] | None:
        try:
            vals = self.store.multi_get([self._key(r) for r in range(self.n)])
        except Exception:
            return None
        out = {}
        for r, v in enumerate(vals):
            beat, seq, state = v.decode().split(" ", 2)
            out[r] = (int(beat), int(seq), state)
        return out

    # -- diagnosis --------------------------------------------------------------------
    def diagnose(self, seq: int, window: float) -> str:
        """Watch the heartbeats for up to ``window`` s and describe who is lost or behind."""
        first = self._read()
        if first is None:
            return self._store_gone_text()
        others = [r for r in range(self.n) if r != self.rank]
        advanced: set[int] = set()
        last = first
        t0 = time.monotonic()
        store_gone = False
        settled = {r for r in others if first[r][2] != "ok"}  # reported an error, or closed
        while time.monotonic() < t0 + window and len(advanced | settled) < len(others):
            time.sleep(self.interval)
            cur = self._read()
            if cur is None:  # e.g. rank 0 exited after its own error: judge by what was seen so far
                store_gone = True
                break
            last = cur
            advanced |= {r for r in others if cur[r][0] != first[r][0]}
            settled |= {r for r in others if cur[r][2] != "ok"}
        watched = time.monotonic() - t0
        failed = [r for r in others if last[r][2].startswith("error")]
        closed = [r for r in others if last[r][2] == "closed"]
        silent = [r for r in others if r not in advanced and r not in failed and r not in closed]
        # A heartbeat is only called lost after several missed beats.
        lost = silent if watched >= 3 * self.interval else []
        behind = {r: last[r][1] for r in others
                  if r in advanced and 0 <= last[r][1] <= seq and r not in failed and r not in closed}
        parts = []
        if lost:
            parts.append(f"lost {self._many(lost)} (no heartbeat for {watched:.1f} s)")
        if failed:
            parts.append(f"{self._many(failed)} failed themselves (see their logs)")
        if closed:
            parts.append(f"{self._many(closed)} closed their communicator (finished, or failed outside a collective)")
        if behind:
            parts.append("alive but not at this collective yet: " + ", ".join(
                f"{self._one(r)} (last launched #{k - 1})" if k else f"{self._one(r)} (launched none)"
                for r, k in behind.items()))
        if store_gone:
            gone = {self._g(r) for r in failed + closed}
            parts.append(self._store_gone_text(exited_after_error=self.store_host in gone))
        return "; ".join(parts) or "no rank is lost: every heartbeat advances and every rank launched it"

    def _store_gone_text(self, exited_after_error: bool = False) -> str:
        if self.store_host is None:
            return "the torchrun agent's store is unreachable (the agent or its host is gone)"
        if exited_after_error:
            return f"{self._host()} then exited, taking the rendezvous store it hosts with it"
        return f"lost {self._host()} (the rendezvous store it hosts is unreachable)"
