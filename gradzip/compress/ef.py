"""Error feedback (EF), a wrapper usable with any compressor.

Algorithm (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019), per key:

1. compensated = gradient + memory
2. payload = inner.compress(compensated)
3. transmitted = inner.decompress(own final payload)  (what this rank contributed)
4. memory = compensated − transmitted                   (the new residual)

Invariant: ``compensated == transmitted + memory``. For multi-round compressors (PowerSGD), steps
3–4 happen on the last round's *local* payload (P Q_localᵀ). The authors' code (Vogels et al. 2019)
and torch's PowerSGD hook keep the residual against the *reduced* Q instead; both choices leave
the same mean residual over ranks, since the mean of the local Qs is the reduced Q.

The memory is kept in fp32 whatever the gradient's dtype, so that small residuals of bf16/fp16
gradients are not rounded away; the output is cast back to the gradient's dtype.
Spelling: ``"topk:ratio=0.01,ef=true"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradzip.compress.base import BucketCompressor, Compressor, Payload, cast_saturating, flatten, unflatten


@dataclass
class _EFCtx:
    inner: Any
    key: str
    compensated: list[Tensor] | None  # kept only until the last round for multi-round inners
    dtypes: list[torch.dtype]
    round: int = 0


def _unalias(payload: Payload, buffers: Sequence[Tensor]) -> Payload:
    """Clone payload tensors that share storage with the memory buffers (lossless inners such as
    ``none`` return a view of their input), since the buffers are overwritten with the residual."""
    ptrs = {b.untyped_storage().data_ptr() for b in buffers if b.numel()}
    return tuple(p.clone() if p.numel() and p.untyped_storage().data_ptr() in ptrs else p for p in payload)


class ErrorFeedback(BucketCompressor):
    """Wraps ``inner``; holds one fp32 residual list per key."""

    def __init__(self, inner: Compressor) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.memory: dict[str, list[Tensor]] = {}  # per key: views of self._flat[key]
        self._flat: dict[str, Tensor] = {}
        # Delegate the inner compressor's declarations (the engine reads these, never .inner).
        # Not `identity`: the payload is the compensated gradient, not the gradient.
        self.name = inner.name
        self.collective = inner.collective
        self.schemes = inner.schemes
        self.exchange = inner.exchange
        self.per_tensor = inner.per_tensor
        self.fixed_size = inner.fixed_size
        self.rounds = inner.rounds
        self.biased = inner.biased
        self.lossless = inner.lossless
        self.description = inner.description
        self.Config = inner.Config

    @property
    def spec(self) -> str:
        return self.inner._spec_with("true")


    def _memory_for(self, key: str, tensors: Sequence[Tensor]) -> list[Tensor]:
        """This key's residuals: fp32 views of one flat buffer (so batching compressors such as
        PowerSGD see neighbouring matrices, and flatten() needs no copy), on the tensors' device."""
        mem = self.memory.get(key)
        device = tensors[0].device if tensors else torch.device("cpu")
        same_shapes = mem is not None and [m.shape for m in mem] == [t.shape for t in tensors]
        if same_shapes and (not mem or mem[0].device == device):
            return mem  # type: ignore[return-value]
        flat = torch.zeros(sum(t.numel() for t in tensors), dtype=torch.float32, device=device)
        if same_shapes and mem:  # e.g. loaded on the CPU, training on CUDA: keep the residual
            flat.copy_(flatten(mem))
        mem = unflatten(flat, [t.shape for t in tensors])
        self.memory[key], self._flat[key] = mem, flat
        return mem

    @torch.no_grad()
    def compress_batch(self, tensors: Sequence[Tensor], key: str = "") -> tuple[Payload, Any]:
        mem = self._memory_for(key, tensors)
        # The memory buffers become the compensated gradient in place (no per-step allocation) and
        # go back to holding the residual in _update_memory.
        for m, t in zip(mem, tensors):
            m.add_(t)
        payload, inner_ctx = self.inner.compress_batch(mem, key)
        payload = _unalias(payload, mem)
        ctx = _EFCtx(inner_ctx, key, mem, [t.dtype for t in tensors])
        if self.inner.rounds == 1:
            self._update_memory(payload, ctx)
        return payload, ctx

    @torch.no_grad()
    def next_round_batch(self, reduced: Payload, ctx: Any) -> tuple[Payload, Any]:
        payload, inner_ctx = self.inner.next_round_batch(reduced, ctx.inner)
        payload = _unalias(payload, ctx.compensated)
        ctx = _EFCtx(inner_ctx, ctx.key, ctx.compensated, ctx.dtypes, ctx.round + 1)
        if ctx.round == self.inner.rounds - 1:
            self._update_memory(payload, ctx)
        return payload, ctx

    def _update_memory(self, payload: Payload, ctx: _EFCtx) -> None:
        # memory := compensated − transmitted, in place.
        transmitted = self.inner.decompress_batch(payload, ctx.inner)
        for m, t in zip(ctx.compensated, transmitted):
            m.sub_(t)
        # A non-finite gradient (an fp16 overflow step that the grad scaler skips) would poison the
        # memory for good: zero those entries (no host sync, unlike an isfinite().all() check).
        self._flat[ctx.key].nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        ctx.compensated = None

    def decompress_batch(self, payload: Payload, ctx: Any) -> list[Tensor]:
        out = self.inner.decompress_batch(payload, ctx.inner)
        return [cast_saturating(o, d) for o, d in zip(out, ctx.dtypes)]

    @torch.no_grad()
    def credit(self, key: str, indices: Tensor, values: Tensor) -> None:
        # Values the exchange dropped were subtracted from the memory as sent: add them back.
        self._flat[key].index_add_(0, indices.to(self._flat[key].device), values.to(torch.float32))

    def aggregate(self, tensors: list[Tensor]) -> Tensor:
        return self.inner.aggregate(tensors)

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        # The inner compressor sees fp32 compensated gradients.
        return self.inner.payload_bytes(shape, torch.float32)

    def batch_payload_bytes(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32) -> int:
        return self.inner.batch_payload_bytes(shapes, torch.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "memory": {k: [m.clone() for m in v] for k, v in self.memory.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))
        self.memory, self._flat = {}, {}
        for key, mems in state.get("memory", {}).items():
            flat = flatten(mems).to(torch.float32, copy=True) if mems else torch.zeros(0)
            self.memory[key], self._flat[key] = unflatten(flat, [m.shape for m in mems]), flat
