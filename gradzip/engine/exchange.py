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

from collections.abc import Sequence

import torch
from torch import Tensor

from gradzip.comm.base import Communicator, Handle
from gradzip.compress.base import Compressor, Payload
from gradzip.compress.fastpaths import DecodeAggregate


class Exchange:
    """The compressor's own collective (``exchange=allreduce`` or ``allgather``). Other schemes
    (:mod:`gradzip.engine.schemes`) follow the same interface: ``start``, ``advance``,
    ``result``, and ``rounds``, ``round``, ``compress_s``, ``link_s`` (modelled link seconds of
    each round on ``sim``; zeros on real backends)."""

    def __init__(self, compressor: Compressor, comm: Communicator, tensors: Sequence[Tensor], key: str = "") -> None:
        self.compressor = compressor
        self.comm = comm
        self.tensors = list(tensors)
        self.key = key
        self.round = 0
        self.rounds = compressor.rounds
        self.compress_s = 0.0  # time spent encoding/decoding on this rank
        self.link_s = [0.0] * self.rounds
        self._ctx = None
        self._handles: list[Handle] = []
        self._result: list[Tensor] | None = None
        self.shareable_s: float | None = None  # set when the result came from the one-pass decode

    # -- phases -------------------------------------------------------------------
    def start(self) -> None:
        t0 = self.comm.work_time()
        payload, self._ctx = self.compressor.compress_batch(self.tensors, self.key)
        self.compress_s += self.comm.work_time() - t0
        self._launch(payload)

    def advance(self) -> bool:
        """Wait for the current round. Launch the next one, or finish. True when finished."""
        if self._result is not None:
            return True
        c = self.compressor
        last = self.round == c.rounds - 1
        if c.collective == "allgather" and last:
            gathered = self._wait_all()  # per payload tensor: list over ranks
            t0 = self.comm.work_time()
            per_rank: list[Payload] = [tuple(g[r] for g in gathered) for r in range(self.comm.world_size)]
            # one pass, no decode per rank, where the compressor has it (fastpaths.DecodeAggregate)
            fused = c.decode_aggregate_batch(per_rank, self._ctx) if isinstance(c, DecodeAggregate) else None
            if fused is not None:
                self._result = fused
                self.shareable_s = self.comm.work_time() - t0
            else:
                parts = [c.decompress_batch(p, self._ctx) for p in per_rank]
                self._result = [c.aggregate([part[i] for part in parts]) for i in range(len(self.tensors))]
            self.compress_s += self.comm.work_time() - t0
            return True
        reduced = tuple(self._wait_all())
        t0 = self.comm.work_time()
        if last:
            self._result = c.decompress_batch(reduced, self._ctx)
            self.compress_s += self.comm.work_time() - t0
            return True
        payload, self._ctx = c.next_round_batch(reduced, self._ctx)
        self.compress_s += self.comm.work_time() - t0
        self.round += 1
        self._launch(payload)
        return False

    def adopt(self, other: Exchange) -> bool:
        """``sim`` only: finish this worker's last round with ``other``'s result, which a worker that
        received the same payloads decoded in one pass (a pure function of the payloads, see
        :class:`gradzip.compress.fastpaths.DecodeAggregate`), and charge its decode time to this worker. False
        (nothing done) when ``other`` took no shareable path or this exchange is not at that round."""
        if type(self) is not Exchange or type(other) is not Exchange or other.shareable_s is None \
                or self._result is not None or self.round != self.compressor.rounds - 1:
            return False
        self._wait_all()  # the round's modelled link time
        self._result = other.result()
        self.compress_s += other.shareable_s
        return True

    def result(self) -> list[Tensor]:
        if self._result is None:
            raise RuntimeError("Exchange.result() before the exchange finished")
        return self._result

    # -- internals ----------------------------------------------------------------
    def _wait_all(self) -> list:
        """Wait for this round's handles; add their modelled link time (sim) to ``link_s``."""
        return wait_all(self._handles, self.link_s, self.round)

    def _launch(self, payload: Payload) -> None:
        c = self.compressor
        final = self.round == c.rounds - 1
        if c.collective == "allgather" and final:
            # Fixed-size payloads have the same shapes on every rank: no size exchange.
            self._handles = [self.comm.allgather_async(p, same_shape=c.fixed_size) for p in payload]
        else:
            self._handles = [self.comm.allreduce_async(p, "mean") for p in payload]


def wait_all(handles: Sequence[Handle], link_s: list[float], rnd: int) -> list:
    """Results of ``handles`` in order; their modelled seconds (``sim``) go to ``link_s[rnd]``.
    A round's collectives run one after the other on one rank's link, so their times add."""
    out = [h.wait() for h in handles]
    link_s[rnd] += sum(getattr(h, "modelled_s", 0.0) for h in handles)
    return out


def pack(payload: Payload) -> Tensor:
    """The payload's tensors as one flat ``uint8`` tensor (one collective instead of several)."""
    parts = [p.reshape(-1).view(torch.uint8) for p in payload]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack(buf: Tensor, like: Payload) -> Payload:
    """Inverse of :func:`pack` for a payload shaped as ``like`` (same sizes and dtypes). Each part
    is copied out, so that it is aligned for its dtype whatever its offset in ``buf``."""
    out, offset = [], 0
    for t in like:
        nb = t.numel() * t.element_size()
        out.append(buf[offset:offset + nb].clone().view(t.dtype).view(t.shape))
        offset += nb
    return tuple(out)
