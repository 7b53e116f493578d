"""``fp16``: cast the gradient to IEEE half precision for the allreduce, and back.

Algorithm: payload = the flat gradient cast to fp16 (2 bytes per element; no copy when the
gradient is already fp16: the payload aliases it, which the Exchange contract allows); the
allreduce averages the payloads; decompress casts back to the gradient's dtype.

``biased = True``, strictly: round-to-nearest casting is deterministic, so E[C(x)] = C(x) != x.
The relative error is at most 2^-11, far below SGD's noise, which is why fp16/bf16 are used without
error feedback in practice. ``ef=true`` removes the bias of each rank's own cast, per rank only:
with 2 or more workers the averaged result is rounded to fp16 again by the reduction, outside
every rank's error feedback.

Range: fp16 overflows above 65504 (to inf, which a GradScaler detects and skips, as in native fp16
training). The Exchange reduces with op="mean": ``sim`` accumulates in fp32, and NCCL's average
pre-scales by 1/N, but a backend that sums in fp16 before dividing can overflow once |g| * N >
65504. We do not pre-scale by 1/N (compressors do not know N): if gradients are that large, use
``bf16`` (fp32's range, 8 bits of mantissa) or loss scaling. Tuning: fp16 keeps 3 more mantissa
bits than bf16; prefer it unless the range is a problem.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradzip.compress.base import Compressor, Payload, cast_saturating, numel_of
from gradzip.compress.bitpack import empty
from gradzip.compress.registry import register


class Cast(Compressor):
    """Base of the casting compressors: subclasses set ``wire_dtype``."""

    collective = "allreduce"
    schemes = ("allreduce", "twophase")
    biased = True
    wire_dtype: torch.dtype = torch.float16

    def __init__(self, config: object = None) -> None:
        super().__init__(config)
        # Scratch buffers per (key, role), reused from step to step: a fresh 64 MiB buffer costs
        # more in page faults than the cast itself. Safe because a key's exchange finishes before
        # the same key is compressed again (the engine's finalize); not state, never saved.
        self._buffers: dict[tuple[str, str], Tensor] = {}

    def _buffer(self, key: str, role: str, like: Tensor, dtype: torch.dtype) -> Tensor:
        buf = self._buffers.get((key, role))
        if buf is None or buf.numel() != like.numel() or buf.dtype != dtype or buf.device != like.device:
            buf = self._buffers[(key, role)] = empty(like.numel(), dtype, like.device)
        return buf

    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, tuple[torch.Size, torch.dtype, str]]:
        flat = tensor.detach().reshape(-1)
        if flat.dtype != self.wire_dtype:
            flat = self._buffer(key, "wire", flat, self.wire_dtype).copy_(flat)
        return (flat,), (tensor.shape, tensor.dtype, key)

    def decompress(self, payload: Payload, ctx: tuple[torch.Size, torch.dtype, str]) -> Tensor:
        """The result is a per-key buffer, valid until the key is decompressed again."""
        shape, dtype, key = ctx
        wire = payload[0]
        if wire.dtype == dtype:
            return wire.view(shape)
        return cast_saturating(wire, dtype, self._buffer(key, "out", wire, dtype)).view(shape)

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        return numel_of(shape) * torch.empty((), dtype=self.wire_dtype).element_size()


@register("fp16")
class FP16(Cast):
    wire_dtype = torch.float16
    description = "cast to fp16 for the allreduce (2 bytes/element; overflows above 65504)"
