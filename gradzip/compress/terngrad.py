"""``terngrad``: stochastic ternary gradients {-1, 0, +1} * max|g| (Wen et al. 2017, TernGrad).

Algorithm, per tensor (any shape, read flat; fp32, fp16 or bf16):

1. scale = max|g| over the tensor, sent as one fp32 (exact: every input value is an fp32).
2. Each element: b = 1 with probability p = |g| / scale, else 0 (uniform numbers with 2^-24
   resolution from the rank's deterministic stream, :mod:`gradzip.compress.quantpack`); the
   decoded value is sign(g) * b * scale, so E[decoded] = g: unbiased.
3. Code 0 (zero), 1 (+scale) or 2 (-scale), 2 bits per element packed 4 per byte (element i in
   bits 2i, 2i+1 of the stream, little-endian). Payload: (ceil(n / 4) bytes, fp32 scale) =
   ceil(n / 4) + 4 bytes, 16x smaller than fp32 for large n; fixed size.
4. Each rank's payload is allgathered; every rank decodes each one and the ranks' tensors are
   averaged.

Randomness: a generator seeded from (``seed``, key, the key's call counter, the int64 sum of the
tensor's bit patterns): ranks with different data round independently, each the same way on
every backend and after a resume (the counter is the state; :mod:`gradzip.compress.quantpack`).
Not done here: the paper's per-layer scale sharing and its gradient clipping to 2.5 standard
deviations (which lowers the variance but biases the estimate). Variance: E||Q(g) - g||^2 =
scale * ||g||_1 - ||g||^2, which grows with the bucket's largest entry: on heavy-tailed gradients
a smaller ``bucket_cap_mb`` gives finer scales. It is no contraction (for Gaussian g the ratio to
||g||^2 is about 0.8 sqrt(2 ln n) - 1: above 1 from n ~ 50, 3 at n = 10^6), so error feedback diverges;
TernGrad is unbiased and converges without it (the default).
Non-finite input: the scale is sent as it is (inf or NaN) and the decoded tensor is non-finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradzip.compress.base import Payload, numel_of
from gradzip.compress.bitpack import INT_VIEW
from gradzip.compress.quantpack import StochasticCode, check_seed, code_bytes, lookup, pack_codes, unpack_codes
from gradzip.compress.registry import register


@dataclass
class TernGradConfig:
    seed: int = 0  # the rounding streams' seed; the same on every rank

    def __post_init__(self) -> None:
        check_seed(self.seed)


@register("terngrad")
class TernGrad(StochasticCode):
    description = "TernGrad: unbiased stochastic ternary {-1,0,+1} * max|g|, 2 bits packed 4/byte + fp32 scale"
    Config = TernGradConfig

    def ef_caveat(self) -> str | None:
        return ("TernGrad is no contraction (its variance grows with max|g| * ||g||_1): error feedback "
                "diverges; TernGrad is unbiased and converges without it")

    @torch.no_grad()
    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, tuple[torch.Size, torch.dtype]]:
        flat = tensor.detach().reshape(-1)
        g = self.generator(flat, key)
        p = flat.abs().float()
        scale = (p.amax() if p.numel() else p.new_zeros(())).reshape(1)  # NaN anywhere -> NaN
        p.div_(scale).nan_to_num_(0.0, 0.0, 0.0)  # 0/0 (all zero), x/NaN, inf/inf -> 0
        keep = torch.rand(flat.numel(), generator=g, device=flat.device) < p
        sign = flat.view(INT_VIEW[flat.dtype]) < 0
        code = keep.to(torch.int32) << sign.to(torch.int32)  # 0, 1 (+) or 2 (-)
        return (pack_codes(code, 2), scale), (tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: tuple[torch.Size, torch.dtype]) -> Tensor:
        shape, dtype = ctx
        packed, scale = payload
        table = scale.double() * torch.tensor([0.0, 1.0, -1.0, 0.0], dtype=torch.float64, device=scale.device)
        return lookup(table, unpack_codes(packed, numel_of(shape), 2), dtype).view(shape)

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        return code_bytes(numel_of(shape), 2) + 4
