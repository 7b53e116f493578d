"""``topk``: keep the k = ceil(ratio * n) entries of largest magnitude (Aji & Heafield 2017).

Algorithm, per tensor (any shape, read flat; fp32, fp16 or bf16):

1. k = max(1, ceil(ratio * n)) for n > 0, 0 for an empty tensor.
2. Exact selection of the k largest |x| (:func:`gradzip.compress.select.topk_indices`: a sampled
   threshold, one filtering pass, exact selection among ~1.5 k candidates; ties go to the lowest
   indices). Far faster than ``torch.topk`` on a CPU, same result.
3. Payload: (values in the tensor's dtype, int32 indices): k * (itemsize + 4) bytes.
4. Each rank's payload is allgathered (indices differ between ranks), scattered into zeros, and the
   ranks' tensors are averaged.

Biased: the dropped mass never arrives. Use it with error feedback (``topk:ratio=0.01,ef=true``),
which makes it converge like uncompressed SGD (Stich et al. 2018). Tuning: ratio 0.01-0.001 with
EF is typical; the payload is (itemsize + 4) / itemsize times the values, so ratio > 0.5 (fp32)
sends more than ``none``. The allgather's received bytes grow with the number of workers, unlike
an allreduce, so top-k pays most on few workers and slow links.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradzip.compress.base import Compressor, Payload, numel_of
from gradzip.compress.fastpaths import DecodeAggregate, ProvesFinite, SubtractSent
from gradzip.compress.registry import register
from gradzip.compress.select import sparse_to_dense, topk_indices


def check_ratio(ratio: float) -> None:
    """Raise ValueError unless 0 < ratio <= 1 (shared by the sparsifiers)."""
    if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be a number with 0 < ratio <= 1, e.g. 0.01; got {ratio!r}")


def k_of(ratio: float, n: int) -> int:
    """Number of kept entries: max(1, ceil(ratio * n)) for n > 0, ignoring float noise (0.01*300=3)."""
    if n <= 0:
        return 0
    q = ratio * n
    k = round(q) if abs(q - round(q)) <= 1e-12 * max(1.0, q) else math.ceil(q)
    return max(1, min(n, k))


@dataclass
class TopKConfig:
    ratio: float = 0.01  # fraction of entries sent; 0 < ratio <= 1

    def __post_init__(self) -> None:
        check_ratio(self.ratio)


@dataclass(frozen=True)
class _Ctx:
    shape: torch.Size
    dtype: torch.dtype  # known identically to every rank: used to decode the others' payloads


_SELF_VALUES: set = set()  # compress methods whose values are the input's own entries


@register("topk")
class TopK(DecodeAggregate, SubtractSent, ProvesFinite, Compressor):
    collective = "allgather"
    schemes = ("allgather", "twophase", "sparse")
    biased = True
    description = "top-k by magnitude: values + int32 indices of the ratio*n largest |g| (exact)"
    Config = TopKConfig

    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, _Ctx]:
        flat = tensor.detach().reshape(-1)
        idx = topk_indices(flat, k_of(self.config.ratio, flat.numel()))
        return (flat[idx], idx), _Ctx(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: _Ctx) -> Tensor:
        values, idx = payload
        return sparse_to_dense(values.to(ctx.dtype), idx, numel_of(ctx.shape)).view(ctx.shape)

    def decode_aggregate(self, payloads: list[Payload], ctx: _Ctx) -> Tensor | None:
        if type(self).aggregate is not Compressor.aggregate or type(self).decompress is not TopK.decompress:
            return None
        # one index_add_ of every rank's entries, in rank order, into zeros: the mean of the dense parts
        out = sparse_to_dense(payloads[0][0].to(ctx.dtype), payloads[0][1], numel_of(ctx.shape))
        if len(payloads) > 1:
            idx = torch.cat([p[1] for p in payloads[1:]]).to(torch.int64)
            out.index_add_(0, idx, torch.cat([p[0].to(ctx.dtype) for p in payloads[1:]]))
        return out.div_(len(payloads)).view(ctx.shape)

    def subtract_sent(self, payload: Payload, ctx: _Ctx, flat: Tensor) -> bool:
        values, idx = payload
        if type(self).compress not in _SELF_VALUES or values.dtype != flat.dtype \
                or flat.numel() != numel_of(ctx.shape):
            return False  # a subclass whose values are not the input's own
        # x − x is +0 for finite x, and NaN for ±inf, which error feedback then zeroes: either way 0
        flat.index_fill_(0, idx.to(torch.int64), 0.0)
        return True

    def sent_proves_finite(self, payload: Payload, ctx: _Ctx) -> bool:
        # The selection ranks NaN above inf above every finite magnitude: finite values sent mean a
        # finite tensor. Off the CPU, checking would sync the device: "not known".
        values = payload[0]
        return type(self).compress is TopK.compress and values.device.type == "cpu" \
            and bool(torch.isfinite(values).all())

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return k_of(self.config.ratio, numel_of(shape)) * (itemsize + 4)


_SELF_VALUES.add(TopK.compress)
