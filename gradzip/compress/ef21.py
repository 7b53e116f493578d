"""EF21 (Richtárik, Sokolov & Fatkhullin 2021), an alternative to classic error feedback for any
biased compressor: ``"topk:ratio=0.01,ef=ef21"``.

Each rank i keeps g_i, its estimate of its own gradient; every rank also keeps g, the mean of the
g_i (the same on every rank, since every rank adds the same reduced payloads). Per key and step:

1. c_i = C(gradient_i − g_i)            (compress the *change* of the gradient)
2. g_i ← g_i + decode(own c_i)          (after the last round, for PowerSGD)
3. exchange: g ← g + mean_i decode(c_i)
4. the output is g (cast to the gradient's dtype).

Classic EF sends C(gradient + memory) and keeps what was not sent; EF21 sends a compressed
correction of a running estimate. Its theory covers any contractive C with full-gradient rates (no
bounded-gradient assumption) and it needs no extra memory for the server's side beyond g. Tuning:
as classic EF; with very sparse C (top-k ≤ 0.1%) g can lag a fast-changing gradient for a few steps.

Both estimates are fp32, per key, checkpointed (``state_dict``); a non-finite step's entries are
zeroed. Supported: the compressor's own collective (allreduce or allgather). Not supported:
``twophase`` and ``sparse`` (their server side would need an estimate per shard), and DDP's bucket
rebuild restarts the estimates (:meth:`residuals` is None).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradzip.compress.base import Compressor, Payload, cast_saturating, key_under
from gradzip.compress.fastpaths import BucketCompressor


@dataclass
class _Ctx:
    inner: Any
    key: str
    dtypes: list[torch.dtype]
    round: int = 0


class EF21(BucketCompressor):
    """Wraps ``inner``; per key the rank's estimate g_i (``local``) and the mean estimate g (``agg``)."""

    def __init__(self, inner: Compressor) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.local: dict[str, list[Tensor]] = {}
        self.agg: dict[str, list[Tensor]] = {}
        self._gather: tuple[list[Tensor], list[torch.dtype]] | None = None  # allgather: for aggregate()
        self._next = 0
        for attr in ("name", "collective", "exchange", "per_tensor", "fixed_size", "rounds", "biased",
                     "lossless", "description", "Config", "host_syncs"):
            setattr(self, attr, getattr(inner, attr))
        self.schemes = (inner.collective,)

    @property
    def spec(self) -> str:
        return self.inner._spec_with("ef21")

    def _estimates(self, key: str, tensors: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        if key not in self.local or [t.shape for t in self.local[key]] != [t.shape for t in tensors]:
            self.local[key] = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in tensors]
            self.agg[key] = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in tensors]
        return self.local[key], self.agg[key]

    @torch.no_grad()
    def compress_batch(self, tensors: Sequence[Tensor], key: str = "") -> tuple[Payload, Any]:
        local, _ = self._estimates(key, tensors)
        diff = [t.float() - g for t, g in zip(tensors, local)]
        payload, inner_ctx = self.inner.compress_batch(diff, key)
        ctx = _Ctx(inner_ctx, key, [t.dtype for t in tensors])
        if self.inner.rounds == 1:
            self._update_local(payload, ctx)
        return payload, ctx

    @torch.no_grad()
    def next_round_batch(self, reduced: Payload, ctx: Any) -> tuple[Payload, Any]:
        payload, inner_ctx = self.inner.next_round_batch(reduced, ctx.inner)
        ctx = _Ctx(inner_ctx, ctx.key, ctx.dtypes, ctx.round + 1)
        if ctx.round == self.inner.rounds - 1:
            self._update_local(payload, ctx)
        return payload, ctx

    def _update_local(self, payload: Payload, ctx: _Ctx) -> None:
        for g, c in zip(self.local[ctx.key], self.inner.decompress_batch(payload, ctx.inner)):
            g.add_(c.float()).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    @torch.no_grad()
    def decompress_batch(self, payload: Payload, ctx: Any) -> list[Tensor]:
        out = self.inner.decompress_batch(payload, ctx.inner)
        if self.collective == "allreduce":  # the reduced payload: g ← g + its decode
            return [self._advance(g, c, d) for g, c, d in zip(self.agg[ctx.key], out, ctx.dtypes)]
        self._gather, self._next = (self.agg[ctx.key], ctx.dtypes), 0  # one rank's payload: aggregate() adds g
        return out

    @torch.no_grad()
    def aggregate(self, tensors: list[Tensor]) -> Tensor:
        assert self._gather is not None, "EF21.aggregate() before decompress_batch()"
        agg, dtypes = self._gather
        i, self._next = self._next, self._next + 1
        return self._advance(agg[i], self.inner.aggregate(tensors), dtypes[i])

    @staticmethod
    def _advance(g: Tensor, mean_change: Tensor, dtype: torch.dtype) -> Tensor:
        g.add_(mean_change.float().reshape(g.shape)).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return cast_saturating(g, dtype).clone()

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        return self.inner.payload_bytes(shape, torch.float32)  # the inner code sees fp32 differences

    def batch_payload_bytes(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32) -> int:
        return self.inner.batch_payload_bytes(shapes, torch.float32)

    def forget(self, key: str) -> None:
        self.inner.forget(key)
        for d in (self.local, self.agg):
            for k in [k for k in d if key_under(k, key)]:
                del d[k]

    def state_dict(self) -> dict[str, Any]:
        def copy(d: dict[str, list[Tensor]]) -> dict[str, list[Tensor]]:
            return {k: [t.clone() for t in v] for k, v in d.items()}
        return {"inner": self.inner.state_dict(), "local": copy(self.local), "agg": copy(self.agg)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))
        self.local = {k: [t.to(torch.float32, copy=True) for t in v] for k, v in state.get("local", {}).items()}
        self.agg = {k: [t.to(torch.float32, copy=True) for t in v] for k, v in state.get("agg", {}).items()}
