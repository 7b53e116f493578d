"""``onebit``: scaled sign, 1 bit per element, with error feedback (EF-SignSGD).

Algorithm (Seide et al. 2014; Karimireddy et al. 2019, "Error feedback fixes SignSGD"), per tensor:

1. scale = mean(|g|) over the tensor (fp32), so that scale * sign(g) has the same l1 norm as g.
2. Payload: the sign bits packed 8 per byte (bit 1 = negative; little-endian bit order) and the
   scale as one fp32: ceil(n / 8) + 4 bytes, i.e. 32x smaller than fp32 for large n.
3. Each rank's payload is allgathered (signs cannot be summed bitwise); every rank decodes each
   payload to scale * (±1) and the ranks' tensors are averaged.

Sign of zero: the float's sign bit decides, so +0 → +scale and -0 → -scale (a 1-bit code cannot
say 0). Biased; error feedback is on by default (``onebit:ef=false`` turns it off), and with it
the method converges like SGD; without it, it can stall far from the optimum.
Tuning: one scale per tensor; the engine compresses a whole bucket as one tensor, so layers with
very different gradient scales share one scale: a smaller ``bucket_cap_mb`` gives finer scales.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradzip.compress import native
from gradzip.compress.base import Compressor, Payload, numel_of
from gradzip.compress.bitpack import mean_abs, pack_signs, packed_numel, sum_signs, unpack_signs
from gradzip.compress.fastpaths import CompressSubtract, DecodeAggregate, ProvesFinite, SubtractSent
from gradzip.compress.registry import register


class SignCode(DecodeAggregate, CompressSubtract, SubtractSent, ProvesFinite, Compressor):
    """Shared by ``onebit`` and ``signsgd``: payload (packed sign bits, fp32 scale = mean |g|)."""

    collective = "allgather"
    schemes = ("allgather", "twophase")
    biased = True

    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, tuple[torch.Size, torch.dtype]]:
        scale = mean_abs(tensor).reshape(1)
        return (pack_signs(tensor), scale), (tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: tuple[torch.Size, torch.dtype]) -> Tensor:
        shape, dtype = ctx
        packed, scale = payload
        return unpack_signs(packed, numel_of(shape), scale, dtype).view(shape)

    def decode_aggregate(self, payloads: list[Payload], ctx: tuple[torch.Size, torch.dtype]) -> Tensor | None:
        if type(self).aggregate is not Compressor.aggregate or type(self).decompress is not SignCode.decompress:
            return None  # signSGD's majority vote aggregates differently
        shape, dtype = ctx
        out = sum_signs([p[0] for p in payloads], numel_of(shape), [p[1] for p in payloads], dtype,
                        divisor=len(payloads))
        return out.view(shape)

    def compress_subtract(self, tensor: Tensor, key: str = "") -> tuple[Payload, Any] | None:
        if type(self).compress is not SignCode.compress or not native.usable(tensor, torch.float32):
            return None
        # one pass: pack the sign bits and subtract copysign(scale, x) (the C kernel, when built)
        scale = mean_abs(tensor).reshape(1)
        packed = native.sign_pack_sub(tensor.reshape(-1), float(scale))
        return None if packed is None else ((packed, scale), (tensor.shape, tensor.dtype))

    def subtract_sent(self, payload: Payload, ctx: tuple[torch.Size, torch.dtype], flat: Tensor) -> bool:
        if type(self).compress is not SignCode.compress or flat.dtype != torch.float32 \
                or flat.numel() != numel_of(ctx[0]):
            return False  # a subclass that encodes something else (Signum: its momentum)
        # The code is the sign bit of each entry, so the decoded value is copysign(scale, entry):
        # subtract it chunk by chunk (the temporary stays in cache; no full-size decode).
        scale = payload[1].to(flat.device, torch.float32).reshape(())
        for part in flat.split(CHUNK):
            part.sub_(torch.copysign(scale, part))
        return True

    def sent_proves_finite(self, payload: Payload, ctx: tuple[torch.Size, torch.dtype]) -> bool:
        # scale = mean |x|: finite only if every entry is (inf and NaN propagate through the sum).
        # Off the CPU, reading it would sync the device: say "not known".
        scale = payload[1]
        return type(self).compress is SignCode.compress and scale.device.type == "cpu" \
            and bool(torch.isfinite(scale).all())

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        return packed_numel(numel_of(shape)) + 4


CHUNK = 1 << 16  # elements per fused error-feedback chunk: 256 KiB of fp32, inside a core's L2


@register("onebit")
class OneBit(SignCode):
    description = "1-bit sign packed 8/byte + fp32 scale mean|g| (EF-SignSGD); error feedback on by default"
    default_ef = True
