"""``none``: the uncompressed reference. The gradient itself is the payload, summed by allreduce."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradzip.compress.base import Compressor, Payload, numel_of
from gradzip.compress.registry import register


@register("none")
class NoCompression(Compressor):
    collective = "allreduce"
    biased = False
    lossless = True
    identity = True
    description = "no compression: allreduce of the gradient in its own dtype (fp32 in fp32 training)"

    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, object]:
        # A view, not a copy: the exchange reduces it in place, as DDP does with its buckets.
        return (tensor.reshape(-1),), tensor.shape

    def decompress(self, payload: Payload, ctx: object) -> Tensor:
        return payload[0].view(ctx)  # type: ignore[arg-type]

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        return numel_of(shape) * torch.empty((), dtype=dtype).element_size()
