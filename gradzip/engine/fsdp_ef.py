"""Error feedback whose memory is stored in a low-precision dtype (``fsdp_compress(ef_dtype=...)``).

Sharded training keeps an error memory the size of every module's reduce-scatter input; in bf16 it
takes half of fp32's memory. Per key, as :class:`gradzip.compress.ef.ErrorFeedback` does but with
the memory rounded to ``dtype`` when stored:

1. compensated = gradient + memory          (in fp32, a temporary of the chunk's size)
2. payload = inner.compress(compensated)
3. transmitted = inner.decompress(payload)   (what this rank contributed)
4. memory = (compensated − transmitted) rounded to ``dtype``; non-finite entries become 0.

The rounding in step 4 loses what bf16 cannot hold of the residual (its 8 mantissa bits); the
residual stays bounded as with fp32. No step transactions (FSDP never undoes a step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradzip.compress.base import Compressor, Payload, cast_saturating, flatten, key_under


class LowPrecisionEF(Compressor):
    """Wraps ``inner``; one flat ``dtype`` memory per key. Declares the inner's capabilities."""

    def __init__(self, inner: Compressor, dtype: torch.dtype) -> None:
        super().__init__(inner.config)
        self.inner, self.dtype = inner, dtype
        self.memory: dict[str, Tensor] = {}
        self.name, self.collective, self.schemes = inner.name, inner.collective, inner.schemes
        self.exchange, self.fixed_size, self.rounds = inner.exchange, inner.fixed_size, inner.rounds
        self.per_tensor, self.biased = inner.per_tensor, inner.biased

    @property
    def spec(self) -> str:
        return self.inner._spec_with("true")

    @torch.no_grad()
    def compress_batch(self, tensors: Sequence[Tensor], key: str = "") -> tuple[Payload, Any]:
        grad = flatten(tensors)
        mem = self.memory.get(key)
        if mem is None or mem.shape != grad.shape or mem.device != grad.device:
            mem = self.memory[key] = torch.zeros(grad.numel(), dtype=self.dtype, device=grad.device)
        compensated = grad.float() + mem.float()
        payload, ctx = self.inner.compress_batch([compensated], key)
        payload = tuple(p.clone() if p.data_ptr() == compensated.data_ptr() else p for p in payload)
        transmitted = self.inner.decompress_batch(payload, ctx)[0]
        mem.copy_((compensated - transmitted).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0))
        return payload, (ctx, [t.dtype for t in tensors], [t.shape for t in tensors])

    def decompress_batch(self, payload: Payload, ctx: Any) -> list[Tensor]:
        inner_ctx, dtypes, shapes = ctx
        out = self.inner.decompress_batch(payload, inner_ctx)[0].reshape(-1)
        parts, offset = [], 0
        for d, s in zip(dtypes, shapes):
            n = s.numel()
            parts.append(cast_saturating(out[offset:offset + n].view(s), d))
            offset += n
        return parts

    def aggregate(self, tensors: list[Tensor]) -> Tensor:
        return self.inner.aggregate(tensors)

    # The core methods: one tensor is a bucket of one.
    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, Any]:
        return self.compress_batch([tensor], key)

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        return self.decompress_batch(payload, ctx)[0]

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        return self.inner.payload_bytes(shape, torch.float32)

    def residuals(self, key: str) -> list[Tensor] | None:
        mem = self.memory.get(key)
        return None if mem is None else [mem]

    def forget(self, key: str) -> None:
        self.inner.forget(key)
        self.memory = {k: v for k, v in self.memory.items() if not key_under(k, key)}

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "memory": {k: v.clone() for k, v in self.memory.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))
        self.memory = {str(k): v.to(self.dtype, copy=True) for k, v in state.get("memory", {}).items()}
