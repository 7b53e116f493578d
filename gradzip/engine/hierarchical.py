"""Hierarchical exchange: compress only what crosses the slow links between nodes.

With ``g`` ranks per node (membership: :mod:`gradzip.comm.topology`), per bucket on each rank:

1. reduce-scatter inside the node, as an alltoall of the bucket cut into g chunks followed by a
   local sum: local rank i now holds the node's mean of shard i (in the gradient's dtype, or in
   ``intra_dtype``, e.g. fp16, on the intra-node wire);
2. the shard goes through the compressor's own exchange scheme (allreduce, allgather, twophase,
   sparse) among the ranks with the same local rank on every node (the cross-node group): the
   g cross-node groups of a node work on their shards side by side;
3. allgather of the g shards inside the node.

Error memory lives where compression happens: each rank's compressor keeps the memory of its own
shard (keys ``<bucket>/node``), and the server memory of ``twophase`` is that of the cross-node
group. With one rank per node the cross-node group is the whole world and the exchange is the flat
one. Tuning: worth it when the intra-node link is much faster than the inter-node one (NVLink or
PCIe against Ethernet); intra-node traffic is 2(g−1)/g of the bucket per rank, uncompressed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradzip.comm.base import Communicator, Handle
from gradzip.comm.topology import topology
from gradzip.compress.base import Compressor, flatten, unflatten
from gradzip.engine.exchange import wait_all
from gradzip.engine.schemes import SchemeState


class HierarchicalScheme:
    """Per-rank state: the node and cross-node communicators and the inner scheme's state.
    Construction splits the communicator (collective); :meth:`bind` builds the inner scheme once
    every rank has split (``sim``: after every worker's construction)."""

    def __init__(self, compressor: Compressor, comm: Communicator, intra_dtype: torch.dtype | None = None) -> None:
        self.comm = comm
        self.compressor = compressor
        self.topo = topology(comm)
        self.intra_dtype = intra_dtype
        self.inner: SchemeState | None = None
        self.leader_inner: SchemeState | None = None
        # per_tensor compressors: only node leaders exchange across nodes, alone on their NIC.
        self._leaders = comm.split(0 if self.topo.local_rank == 0 else comm.world_size + comm.rank) \
            if compressor.per_tensor else None

    def bind(self) -> None:
        if self.inner is None:
            self.inner = SchemeState(self.compressor, self.topo.cross)
            if self._leaders is not None:
                self.leader_inner = SchemeState(self.compressor, self._leaders)

    @property
    def ranks_per_node(self) -> int:
        return self.topo.ranks_per_node

    def exchange(self, compressor: Compressor, tensors: Sequence[Tensor], key: str) -> Any:
        self.bind()
        assert self.inner is not None
        if self.topo.ranks_per_node == 1:  # one rank per node: the flat exchange over everyone
            return self.inner.exchange(compressor, tensors, key)
        return HierarchicalExchange(compressor, self, tensors, key)

    def residual(self, key: str, numel: int) -> Tensor | None:
        """This rank's error memory of the bucket exchanged under ``key`` (``numel`` elements), as
        a flat bucket-sized tensor to add to this rank's next local gradient: its shard's memory (a
        node's leader: the whole bucket's, for per_tensor compressors) at the shard's place, times
        the ranks per node, since the node averages local gradients before compressing; zeros
        elsewhere. None when it holds none. (For the per-bucket choice of compressors.)"""
        self.bind()
        g = self.topo.ranks_per_node
        if g == 1:
            assert self.inner is not None
            return self.inner.residual(key, numel)
        if self.compressor.per_tensor:
            if self.leader_inner is None or self.topo.local_rank != 0:
                return None
            mem = self.leader_inner.residual(f"{key}/node", numel)
            return None if mem is None else mem * g
        chunk = math.ceil(numel / g) if numel else 0
        assert self.inner is not None
        mem = self.inner.residual(f"{key}/node", chunk)
        if mem is None:
            return None
        out = mem.new_zeros(g * chunk)
        out[self.topo.local_rank * chunk:(self.topo.local_rank + 1) * chunk] = mem * g
        return out[:numel]

    def forget(self, key: str) -> None:
        """Free every state of ``key`` (its shard's, or the leader's, under ``key/node``)."""
        self.bind()
        assert self.inner is not None
        for inner in (self.inner, self.leader_inner):
            if inner is not None:
                inner.forget(key)
                inner.forget(f"{key}/node")

    def compressors(self) -> list[Compressor]:
        self.bind()
        assert self.inner is not None
        return self.inner.compressors() + (self.leader_inner.compressors() if self.leader_inner else [])

    def state_dict(self) -> dict[str, Any]:
        self.bind()
        assert self.inner is not None
        out = {"inner": self.inner.state_dict()}
        if self.leader_inner is not None:
            out["leaders"] = self.leader_inner.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bind()
        assert self.inner is not None
        self.inner.load_state_dict(state.get("inner", {}))
        if self.leader_inner is not None:
            self.leader_inner.load_state_dict(state.get("leaders", {}))


class HierarchicalExchange:
    """One bucket's hierarchical exchange (module docstring); the Exchange interface. Three rounds
    on every rank: the intra-node step, the inner scheme (all its rounds, as one), the intra-node
    step back. ``per_tensor`` compressors (PowerSGD) need whole matrices, so for them the node
    allreduces the bucket and its leader (local rank 0) alone compresses across nodes, then
    broadcasts the result inside the node."""

    rounds = 3

    def __init__(self, compressor: Compressor, scheme: HierarchicalScheme, tensors: Sequence[Tensor],
                 key: str) -> None:
        # per_tensor compressors support only their own collective (schemes), so the leader's
        # inner exchange takes exactly compressor.rounds advances: the others count them.
        self.compressor, self.scheme = compressor, scheme
        self.node = scheme.topo.node
        self.g = scheme.ranks_per_node
        self.leader_only = compressor.per_tensor
        self.tensors = list(tensors)
        self.shapes = [t.shape for t in self.tensors]
        self.key = key
        self.round = 0
        self.compress_s = 0.0
        self.link_s = [0.0, 0.0, 0.0]
        self._phase = "intra"
        self._handle: Handle | None = None
        self._inner: Any = None
        self._result: list[Tensor] | None = None

    def start(self) -> None:
        t0 = self.scheme.comm.work_time()
        flat = flatten(self.tensors)
        self.numel, self.dtype = flat.numel(), flat.dtype
        self.wire = self.scheme.intra_dtype or flat.dtype
        if self.leader_only:
            self._buf = flat.to(self.wire, copy=True)
            self.compress_s += self.scheme.comm.work_time() - t0
            self._handle = self.node.allreduce_async(self._buf, "mean")
            return
        self.chunk = math.ceil(self.numel / self.g) if self.numel else 0
        buf = flat.new_zeros(self.g * self.chunk, dtype=self.wire)  # padded; also the cast to the wire dtype
        buf[:self.numel] = flat
        self.compress_s += self.scheme.comm.work_time() - t0
        self._handle = self.node.alltoall_async(buf)

    def advance(self) -> bool:
        if self._result is not None:
            return True
        if self._phase == "intra":
            (got,) = wait_all([self._handle], self.link_s, 0)  # type: ignore[list-item]
            t0 = self.scheme.comm.work_time()
            if self.leader_only:
                reduced = got.to(self.dtype)
                if self.node.rank == 0:
                    self._start_inner(unflatten(reduced, self.shapes), self.scheme.leader_inner)
                else:
                    # Collectives on the node communicator must come in the same order on every
                    # rank: launch the receiving end of the leader's broadcast on the advance where
                    # the leader launches it, after its inner exchange's `rounds` advances.
                    self._bcast = torch.empty(self.numel, dtype=self.wire, device=got.device)
                    self._idle, self._phase = self.compressor.rounds, "idle"
            else:
                shard = got.view(self.g, self.chunk).to(torch.float32).sum(0).div_(self.g).to(self.dtype)
                self._start_inner([shard], self.scheme.inner)
            self.compress_s += self.scheme.comm.work_time() - t0
            self.round = 1
            return False
        if self._phase == "idle":
            self._idle -= 1
            if self._idle == 0:
                self._handle = self.node.broadcast_async(self._bcast, 0)
                self._phase, self.round = "back", 2
            return False
        if self._phase == "inner":
            c0 = self._inner.compress_s
            done = self._inner.advance()
            self.compress_s += self._inner.compress_s - c0
            if not done:
                return False
            self.link_s[1] = sum(self._inner.link_s)
            out = self._inner.result()
            if self.leader_only:
                self._bcast = flatten(out).to(self.wire)
                self._handle = self.node.broadcast_async(self._bcast, 0)
            else:
                self._handle = self.node.allgather_async(out[0].to(self.wire), same_shape=True)  # equal shards
            self._phase, self.round = "back", 2
            return False
        got = wait_all([self._handle], self.link_s, 2)[0]  # type: ignore[list-item]
        t0 = self.scheme.comm.work_time()
        flat = (got if self.leader_only else torch.cat(got)[:self.numel]).to(self.dtype)
        self._result = unflatten(flat, self.shapes) if len(self.shapes) > 1 or self.leader_only \
            else [flat.view(self.shapes[0])]
        self.compress_s += self.scheme.comm.work_time() - t0
        return True

    def _start_inner(self, tensors: list[Tensor], inner: SchemeState | None) -> None:
        assert inner is not None
        self._inner = inner.exchange(self.compressor, tensors, f"{self.key}/node")
        self._inner.start()
        self._phase = "inner"

    def result(self) -> list[Tensor]:
        if self._result is None:
            raise RuntimeError("HierarchicalExchange.result() before the exchange finished")
        return self._result
