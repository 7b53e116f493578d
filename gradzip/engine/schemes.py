"""Exchange schemes: how the ranks' compressed payloads are combined, orthogonal to the compressor.

A compressor's spec picks one of the schemes its class declares (``schemes``), e.g.
``"onebit:exchange=twophase"``; the default is the compressor's own ``collective``:

- ``allreduce`` / ``allgather`` (:class:`gradzip.engine.exchange.Exchange`): payloads are
  averaged elementwise, or every rank receives and decodes the n−1 others' payloads. The
  allgather's traffic and decode work grow linearly with the number of ranks.
- ``twophase`` (:class:`TwoPhaseExchange`): the compressed allreduce of DeepSpeed's 1-bit Adam
  (Tang et al. 2021). Per bucket, on each of n ranks:

  1. cut the bucket into n equal chunks (the last one zero-padded) and compress each chunk,
     with the worker error memory when the spec has ``ef=true``;
  2. an alltoall sends chunk j of every rank to rank j;
  3. rank j decodes the n payloads of its shard, combines them with the compressor's
     ``aggregate`` (the mean; signSGD's majority vote) and compresses the result again, with a
     *server* error memory of 1/n of the bucket (again only with ``ef=true``);
  4. an allgather returns every rank's compressed shard; each rank decodes all n.

  Per-rank traffic is the payload twice, (n−1)/n of it each way, whatever n. Numerically the
  server's second compression adds error (kept in the server memory under EF); chunking also
  changes per-bucket statistics into per-chunk ones (one ``onebit`` scale per chunk).

- the compressed reduce-scatter (:class:`ReduceScatterExchange`): steps 1-3 of ``twophase``
  alone, each rank keeping its combined chunk (FSDP's reduce-scatter, :mod:`gradzip.engine.fsdp`;
  not a spec's scheme, since its result is a chunk rather than the bucket).

- ``sparse`` (:class:`gradzip.engine.gtopk.SparseExchange`): gTop-k for top-k payloads, a
  recursive-doubling reduction that keeps k entries at every level: 8k·log2(n) bytes per rank.

Each scheme is one entry of the registry :mod:`gradzip.compress.schemes` (its exchange class, its
per-rank set-up and its cost model); a new one is registered there, not added here. Persistent
per-rank state of the schemes (the server compressor and its memory) lives in a
:class:`SchemeState`; the engine and the DDP adapter keep one per rank and checkpoint it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradzip.comm.base import Communicator, Handle
from gradzip.compress.base import Compressor, flatten, unflatten
from gradzip.compress.registry import create
from gradzip.compress.schemes import Scheme, get_scheme
from gradzip.engine.exchange import Exchange, pack, unpack, wait_all


def twophase_server(compressor: Compressor, comm: Communicator) -> Compressor:
    """The ``twophase`` scheme's per-rank state (:mod:`gradzip.compress.schemes`): the server, a
    second instance of the same spec that compresses this rank's shard (its error memory is the
    server memory). Built whatever the world size, so that checkpoints carry it on one rank too."""
    return create(compressor.spec)


class SchemeState:
    """Per-rank state of the exchange scheme of ``compressor`` that persists across steps.

    The scheme is looked up in the registry (:mod:`gradzip.compress.schemes`) and its ``setup``
    builds ``state``: ``twophase``'s server compressor, ``sparse``'s pair sub-communicators of
    gTop-k (:mod:`gradzip.engine.gtopk`). Build it on every rank at set-up, in the same order: it
    may split the communicator.
    """

    def __init__(self, compressor: Compressor, comm: Communicator) -> None:
        self.scheme = compressor.exchange
        self.comm = comm
        self.compressor = compressor
        self.spec: Scheme = get_scheme(self.scheme)
        self.state: Any = self.spec.setup_state(compressor, comm)

    @property
    def server(self) -> Compressor | None:
        """The compressor the scheme owns (``twophase``'s server), or None."""
        return self.state if isinstance(self.state, Compressor) else None

    def bind(self) -> None:
        """Nothing to finish (see :class:`gradzip.engine.hierarchical.HierarchicalScheme`)."""

    def exchange(self, compressor: Compressor, tensors: Sequence[Tensor], key: str) -> Any:
        """A new exchange of one bucket by this scheme (``compressor`` may be the plain ``none``
        used for small tensors, which always takes its own collective). On one rank, or for the
        compressor's own collective, the plain :class:`~gradzip.engine.exchange.Exchange`."""
        cls = self.spec.exchange_class()
        if cls is not None and compressor.exchange == self.scheme and self.comm.world_size > 1:
            return cls(compressor, self.state, self.comm, tensors, key)
        return Exchange(compressor, self.comm, tensors, key)

    # -- a bucket's worker error memory, whatever the scheme (DDP's bucket rebuild moves it) --
    def _chunked(self) -> bool:
        return self.spec.chunked and self.comm.world_size > 1

    def residual(self, key: str, numel: int) -> Tensor | None:
        """The worker error memory of the bucket exchanged under ``key`` (``numel`` elements),
        flat, or None. ``twophase`` keeps it per chunk (``key/j``); the server memory, a shard
        of the chunked bucket held by one rank, cannot follow a new bucket layout and is not in it."""
        c = self.compressor
        if not self._chunked():
            mem = c.residuals(key)
            return None if mem is None else flatten(mem)
        parts = [c.residuals(f"{key}/{j}") for j in range(self.comm.world_size)]
        if any(p is None for p in parts):
            return None
        return torch.cat([flatten(p) for p in parts])[:numel]  # type: ignore[arg-type]

    def set_residual(self, key: str, flat: Tensor, shapes: Sequence[torch.Size]) -> None:
        """Make ``flat`` the worker error memory of a bucket of ``shapes`` exchanged under ``key``."""
        c = self.compressor
        if not self._chunked():
            c.set_residuals(key, unflatten(flat, shapes))
            return
        n = self.comm.world_size
        chunk = math.ceil(flat.numel() / n)
        padded = flat.new_zeros(chunk * n)
        padded[:flat.numel()] = flat
        for j in range(n):
            c.set_residuals(f"{key}/{j}", [padded[j * chunk:(j + 1) * chunk]])

    def forget(self, key: str) -> None:
        """Free every state of ``key``: the compressor's and the server's."""
        self.compressor.forget(key)
        if self.server is not None:
            self.server.forget(key)

    def compressors(self) -> list[Compressor]:
        """The stateful compressors this scheme owns (whose steps the engine may undo)."""
        return [self.server] if self.server is not None else []

    def state_dict(self) -> dict[str, Any]:
        return {"server": self.server.state_dict()} if self.server is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.server is not None:
            self.server.load_state_dict(state.get("server", {}))
        elif state:
            raise ValueError(f"scheme {self.scheme} keeps no state but got keys {sorted(state)}")


class ReduceScatterExchange:
    """One bucket's compressed reduce-scatter: steps 1-3 of ``twophase`` (module docstring), one
    round, with this rank's combined chunk as the result. Same interface as
    :class:`~gradzip.engine.exchange.Exchange`.

    Rank j combines the n payloads of its chunk: a lossless payload (``identity``: the gradient
    itself) is summed and divided once by ``sum_div`` (None: not divided), as a backend's
    reduce-scatter does; payloads that average elementwise (``collective == "allreduce"``) are
    averaged and decoded once; the others are decoded one by one and combined by the compressor's
    ``aggregate`` (the mean; signSGD's majority vote), and those two are multiplied by
    ``mean_scale``. ``scale=(mean_scale, sum_div)``; None gives the mean, ``(1.0, n)``.
    ``result()``: ``[chunk]``, this rank's flat chunk of ceil(numel/n) elements (a bucket whose size
    n does not divide is zero-padded at its end)."""

    rounds = 1

    def __init__(self, compressor: Compressor, comm: Communicator, tensors: Sequence[Tensor], key: str,
                 scale: tuple[float, float | None] | None = None) -> None:
        self.compressor, self.comm = compressor, comm
        self.tensors = list(tensors)
        self.shapes = [t.shape for t in self.tensors]
        self.key = key
        self.scale = scale if scale is not None else (1.0, float(comm.world_size))
        self.round = 0
        self.compress_s = 0.0
        self.link_s = [0.0] * self.rounds
        self._handle: Handle | None = None
        self._result: list[Tensor] | None = None

    def _chunks(self, flat: Tensor) -> list[Tensor]:
        """n chunks of ceil(numel/n) elements: views, except a zero-padded copy at the end."""
        n, numel = self.comm.world_size, flat.numel()
        self.numel, self.chunk = numel, math.ceil(numel / n)
        out = []
        for j in range(n):
            lo, hi = min(j * self.chunk, numel), min((j + 1) * self.chunk, numel)
            if hi - lo == self.chunk:
                out.append(flat[lo:hi])
            else:
                padded = flat.new_zeros(self.chunk)
                padded[:hi - lo] = flat[lo:hi]
                out.append(padded)
        return out

    def start(self) -> None:
        t0 = self.comm.work_time()
        c, r = self.compressor, self.comm.rank
        flat = flatten(self.tensors)
        self._mine_dtype = flat.dtype
        chunks = self._chunks(flat)
        rows = []
        for j, chunk in enumerate(chunks):
            payload, ctx = c.compress_batch([chunk], f"{self.key}/{j}")
            if j == r:  # decodes every rank's chunk r: same size, same key (the contract)
                self._mine, self._ctx = payload, ctx
            rows.append(pack(payload))
        send = torch.stack(rows) if rows[0].numel() else torch.empty(len(rows), 0, dtype=torch.uint8,
                                                                     device=flat.device)
        self.compress_s += self.comm.work_time() - t0
        self._handle = self.comm.alltoall_async(send)

    def _wait(self) -> list[Tensor]:
        """This round's received rows (one per rank), its link time added to ``link_s``."""
        assert self._handle is not None, "advance() before start()"
        (got,) = wait_all([self._handle], self.link_s, self.round)
        return got

    def _decoded(self, got: list[Tensor]) -> list[Tensor]:
        """Every rank's payload of this rank's chunk, decoded. A decoded tensor may be a buffer
        that the next decode of the key reuses (casts): each is copied."""
        c = self.compressor
        return [c.decompress_batch(unpack(row, self._mine), self._ctx)[0].clone() for row in got]

    def advance(self) -> bool:
        if self._result is not None:
            return True
        got = self._wait()
        t0 = self.comm.work_time()
        self._result = [self._combine(got)]
        self.compress_s += self.comm.work_time() - t0
        return True

    def _combine(self, got: list[Tensor]) -> Tensor:
        c, n = self.compressor, self.comm.world_size
        mean_scale, sum_div = self.scale
        if c.identity:  # the payload is the gradient: sum it and divide once, as the backend would
            total = unpack(got[0], self._mine)[0].clone()
            for row in got[1:]:
                total += unpack(row, self._mine)[0]
            return total.div_(sum_div) if sum_div is not None else total
        if c.collective == "allreduce":  # payloads average elementwise: decode the mean once
            payloads = [unpack(row, self._mine) for row in got]
            mean = tuple(torch.stack([p[i] for p in payloads]).sum(0).div_(n) for i in range(len(self._mine)))
            out = c.decompress_batch(mean, self._ctx)[0]
        else:
            out = c.aggregate(self._decoded(got))
        out = out.reshape(-1)
        return out.mul_(mean_scale) if mean_scale != 1.0 else out

    def result(self) -> list[Tensor]:
        if self._result is None:
            raise RuntimeError(f"{type(self).__name__}.result() before the exchange finished")
        return self._result


class TwoPhaseExchange(ReduceScatterExchange):
    """One bucket's compressed allreduce (see the module docstring). Same interface as
    :class:`~gradzip.engine.exchange.Exchange`; two rounds: the alltoall of
    :class:`ReduceScatterExchange`, then the allgather of the server's compressed shards."""

    rounds = 2

    def __init__(self, compressor: Compressor, server: Compressor, comm: Communicator,
                 tensors: Sequence[Tensor], key: str) -> None:
        super().__init__(compressor, comm, tensors, key)
        self.server = server

    def advance(self) -> bool:
        if self._result is not None:
            return True
        got = self._wait()
        t0 = self.comm.work_time()
        if self.round == 0:
            shard = self.compressor.aggregate(self._decoded(got))
            payload, self._sctx = self.server.compress_batch([shard], f"{self.key}/server")
            self._smine = payload
            self.round = 1
            self.compress_s += self.comm.work_time() - t0
            self._handle = self.comm.allgather_async(pack(payload), same_shape=self.server.fixed_size)
            return False
        out = torch.empty(len(got) * self.chunk, dtype=self._mine_dtype, device=got[0].device)
        for i, buf in enumerate(got):  # written out at once: a decode may reuse its buffer
            out[i * self.chunk:(i + 1) * self.chunk] = self.server.decompress_batch(unpack(buf, self._smine),
                                                                                    self._sctx)[0]
        flat = out[:self.numel]
        self._result = unflatten(flat, self.shapes) if len(self.shapes) > 1 else [flat.view(self.shapes[0])]
        self.compress_s += self.comm.work_time() - t0
        return True
