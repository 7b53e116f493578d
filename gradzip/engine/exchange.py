"""Drive one bucket's compressed exchange over a Communicator.

This is the only place where a compressor meets a communicator: compressors know nothing of
communication, communicators know nothing of compression.

An :class:`Exchange` is a small state machine so that the ``sim`` backend (all workers in one
thread) and real backends (one worker per process) share it::

    ex = Exchange(compressor, comm, tensors, key)
    ex.start()                # compress, launch round 0 asynchronously
    while not ex.advance():   # wait for the current round; launch the next, if any
        pass
    averaged = ex.result()    # list of tensors: the mean over ranks, original shapes/dtypes

With ``sim``, the engine calls ``start()`` on every worker's exchange, then ``advance()`` on every
worker's exchange in turn, round after round: a round completes once every worker launched it.

Contract: the payload tensors are reduced in place, and for ``none`` they alias the input, so the
input tensors may be overwritten (as DDP's in-place allreduce does).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from torch import Tensor

from gradzip.comm.base import Communicator, Handle
from gradzip.compress.base import Compressor, Payload


class Exchange:
    def __init__(self, compressor: Compressor, comm: Communicator, tensors: Sequence[Tensor], key: str = "") -> None:
        self.compressor = compressor
        self.comm = comm
        self.tensors = list(tensors)
        self.key = key
        self.round = 0
        self.compress_s = 0.0  # time spent encoding/decoding on this rank
        self._ctx = None
        self._handles: list[Handle] = []
        self._result: list[Tensor] | None = None

    # -- phases -------------------------------------------------------------------
    def start(self) -> None:
        t0 = time.perf_counter()
        payload, self._ctx = self.compressor.compress_batch(self.tensors, self.key)
        self.compress_s += time.perf_counter() - t0
        self._launch(payload)

    def advance(self) -> bool:
        """Wait for the current round. Launch the next one, or finish. True when finished."""
        if self._result is not None:
            return True
        c = self.compressor
        last = self.round == c.rounds - 1
        if c.collective == "allgather" and last:
            gathered = [h.wait() for h in self._handles]  # per payload tensor: list over ranks
            t0 = time.perf_counter()
            per_rank: list[Payload] = [tuple(g[r] for g in gathered) for r in range(self.comm.world_size)]
            parts = [c.decompress_batch(p, self._ctx) for p in per_rank]
            self._result = [c.aggregate([part[i] for part in parts]) for i in range(len(self.tensors))]
            self.compress_s += time.perf_counter() - t0
            return True
        reduced = tuple(h.wait() for h in self._handles)
        t0 = time.perf_counter()
        if last:
            self._result = c.decompress_batch(reduced, self._ctx)
            self.compress_s += time.perf_counter() - t0
            return True
        payload, self._ctx = c.next_round_batch(reduced, self._ctx)
        self.compress_s += time.perf_counter() - t0
        self.round += 1
        self._launch(payload)
        return False

    def result(self) -> list[Tensor]:
        if self._result is None:
            raise RuntimeError("Exchange.result() before the exchange finished")
        return self._result

    # -- internals ----------------------------------------------------------------
    def _launch(self, payload: Payload) -> None:
        c = self.compressor
        final = self.round == c.rounds - 1
        if c.collective == "allgather" and final:
            self._handles = [self.comm.allgather_async(p) for p in payload]
        else:
            self._handles = [self.comm.allreduce_async(p, "mean") for p in payload]
