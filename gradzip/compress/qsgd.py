"""``qsgd``: stochastic quantisation to s levels of the tensor's norm (Alistarh et al. 2017, QSGD).

Algorithm, per tensor (any shape, read flat; fp32, fp16 or bf16; s = ``levels``):

1. norm = ||g||_2, computed in fp64 (no overflow of the squares) and sent as one fp32.
2. Each element: r = s * |g| / norm in [0, s]; level = floor(r) + 1 with probability r - floor(r),
   else floor(r) (uniform numbers with 2^-24 resolution, from the rank's deterministic stream:
   :mod:`gradzip.compress.quantpack`). So E[level] = r and E[decoded] = g: unbiased.
3. Code = level | sign << L, L = ceil(log2(s + 1)) bits (sign = the float's sign bit), b = L + 1
   bits per element packed densely (:func:`~gradzip.compress.quantpack.pack_codes`).
   Payload: (ceil(n * b / 8) bytes, fp32 norm) = ceil(n * b / 8) + 4 bytes; fixed size.
4. Each rank's payload is allgathered; every rank decodes each one to ±level * norm / s (a table
   of 2^b values in fp64, clamped to the output dtype's range) and the ranks' tensors are averaged.

Randomness: a generator seeded from (``seed``, key, the key's call counter, the int64 sum of the
tensor's bit patterns): ranks with different data round independently, each the same way on
every backend and after a resume (the counter is the state; :mod:`gradzip.compress.quantpack`).
Variance: E||Q(g) - g||^2 <= min(n / s^2, sqrt(n) / s) * ||g||^2. The engine quantises a whole
bucket against one norm, so on large buckets the variance grows like sqrt(n) / s and most small
entries round to 0. The default ``levels=127`` is the largest s whose sign + level fit one byte
(4x smaller than fp32, no wasted code); keep s = 2^k - 1 (any other s wastes part of its L bits).
Fewer levels (15: 5 bits) suit small buckets (``bucket_cap_mb``): keep n below about s^2.
Error feedback (``ef=true``) needs a contraction, i.e. n < ~s^2: unbiased, QSGD needs no EF.
Non-finite input: the norm is sent as it is (inf or NaN), so the decoded tensor is non-finite
as well and the engine's check (or a GradScaler) sees it; nothing persistent depends on values.
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

MAX_LEVELS = 2**15 - 1  # sign + level in 16 bits


@dataclass
class QSGDConfig:
    levels: int = 127  # s: levels per sign; 2^k - 1 uses every code of its k + 1 bits
    seed: int = 0  # the rounding streams' seed; the same on every rank

    def __post_init__(self) -> None:
        s = self.levels
        if not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= MAX_LEVELS:
            raise ValueError(f"levels must be an integer with 1 <= levels <= {MAX_LEVELS}, e.g. 127 "
                             f"(one byte per element) or 15 (5 bits); got {s!r}")
        check_seed(self.seed)


@register("qsgd")
class QSGD(StochasticCode):
    description = "QSGD: unbiased stochastic rounding to s levels of the fp32 norm; sign + ceil(log2(s+1)) bits"
    Config = QSGDConfig

    @property
    def bits(self) -> int:
        """Bits per element: ceil(log2(s + 1)) for the level, 1 for the sign."""
        return self.config.levels.bit_length() + 1

    def ef_caveat(self) -> str | None:
        return (f"QSGD's variance grows like sqrt(n)/levels: on buckets of more than ~levels^2 = "
                f"{self.config.levels ** 2} elements it is no contraction and error feedback diverges; "
                f"QSGD is unbiased and converges without it")

    @torch.no_grad()
    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, tuple[torch.Size, torch.dtype]]:
        flat = tensor.detach().reshape(-1)
        s, level_bits = self.config.levels, self.bits - 1
        g = self.generator(flat, key)
        norm = torch.linalg.vector_norm(flat, dtype=torch.float64).float().reshape(1)
        r = flat.abs().float().div_(norm).mul_(s).nan_to_num_(0.0, 0.0, 0.0)  # 0/0 and NaN/x -> 0
        low = r.floor()
        u = torch.rand(flat.numel(), generator=g, device=flat.device)
        level = low.add_(u.lt_(r.sub_(low))).clamp_(0, s).to(torch.int32)
        sign = (flat.view(INT_VIEW[flat.dtype]) < 0).to(torch.int32)
        code = level.bitwise_or_(sign.bitwise_left_shift_(level_bits))
        return (pack_codes(code, self.bits), norm), (tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: tuple[torch.Size, torch.dtype]) -> Tensor:
        shape, dtype = ctx
        packed, norm = payload
        half = torch.arange(1 << (self.bits - 1), dtype=torch.float64, device=norm.device)
        half *= norm.double() / self.config.levels
        codes = unpack_codes(packed, numel_of(shape), self.bits)
        return lookup(torch.cat([half, -half]), codes, dtype).view(shape)

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        return code_bytes(numel_of(shape), self.bits) + 4
