"""``scaledsign``: one sign per element and one scale per bucket, the root mean square of its entries.

The example of the compressor contract (:mod:`gradzip.compress.base`): it implements the core and
nothing else, no optional path of :mod:`gradzip.compress.fastpaths`. Per tensor:

1. scale = ‖g‖₂ / √n (in fp64, so that no finite gradient overflows it), so that scale · sign(g) has
   the same l2 norm as g;
2. payload: the sign bits packed 8 per byte (bit 1: the float's sign bit is set) and the scale as
   one fp32: ⌈n/8⌉ + 4 bytes;
3. allgather; every rank decodes each payload to ±scale and the ranks' tensors are averaged.

Biased (``ef=true`` adds error feedback); ``onebit`` is the same code with the scale mean |g|.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradzip.compress.base import Compressor, Payload, numel_of
from gradzip.compress.bitpack import pack_signs, packed_numel, unpack_signs
from gradzip.compress.registry import register


@register("scaledsign")
class ScaledSign(Compressor):
    collective = "allgather"
    biased = True
    description = "sign bits packed 8/byte + fp32 scale ||g||/sqrt(n) (the contract's example)"

    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, tuple[torch.Size, torch.dtype]]:
        flat = tensor.detach().reshape(-1)
        rms = flat.double().norm() / max(1, flat.numel()) ** 0.5
        return (pack_signs(flat), rms.float().reshape(1)), (tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: tuple[torch.Size, torch.dtype]) -> Tensor:
        (packed, scale), (shape, dtype) = payload, ctx
        return unpack_signs(packed, numel_of(shape), scale, dtype).view(shape)

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        return packed_numel(numel_of(shape)) + 4
