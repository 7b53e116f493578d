"""``intk``: block-wise absmax int2/4/8 quantisation with stochastic rounding (ZeRO++'s qgZ).

Algorithm (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant
Model Training"), per flat tensor of n elements, with L = 2^(bits-1) - 1 (1, 7 or 127):

1. Cut it into ceil(n / block) blocks of ``block`` elements (the last one shorter).
2. Per block, scale = max |x| in fp32 (fp16 would overflow above 65504 and flush small scales).
3. Each element: y = x / scale * L in [-L, L], q = floor(y + u), u ~ U[0, 1): stochastic rounding,
   E[q] = y, clamped to [-L, L] (fp32 rounding of y + u); a block with scale 0 gives q = 0.
4. Payload: codes q + L (offset binary, in [0, 2L]) packed ``bits`` per element (element
   (8/bits)·i + j in bits [j·bits, (j+1)·bits) of byte i) and the fp32 scales:
   exactly ceil(n·bits/8) + 4·ceil(n/block) bytes (8 bits, block 256: ~3.9x smaller than fp32).
5. Decode: (q / L) · scale, cast to the tensor's dtype (no overflow, even for scales near fp32's max).
Unbiased (E[decode] = x up to fp32 rounding): no error feedback by default. Collective: allgather,
and ``twophase`` (a chunk's payload decodes with any rank's context of its size). Not allreduce:
ranks' blocks have different scales, so the mean of codes is not the mean of reconstructions.
Randomness: a generator seeded by a hash of (``seed``, key, the key's step counter in the state,
the sum modulo 2^32 of the tensor's fp32 bit patterns: integer addition is exact in any order,
unlike a float sum). So sim, gloo and mpi draw alike, and ranks with different gradients round
independently (bit-identical gradients round alike). No global RNG, no clock.
Non-finite values: a block holding inf or NaN has a non-finite scale and decodes to NaN entirely
(caught by the engine's non-finite step skipping); counters stay finite; never fp32 instead.
Tuning: the error per element is below scale/L: ``bits=8`` is mild, ``bits=4`` (ZeRO++) adds variance
SGD tolerates, ``bits=2`` is noisy. A smaller ``block`` tracks outliers but costs 32/block bits/element.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradzip.compress.base import Compressor, KeyCounters, Payload, numel_of
from gradzip.compress.bitpack import empty
from gradzip.compress.quantpack import pack_codes, unpack_codes
from gradzip.compress.registry import register


@dataclass
class IntKConfig:
    bits: int = 8  # bits per element: 2, 4 or 8
    block: int = 256  # elements per fp32 scale; >= 1
    seed: int = 0  # of the rounding noise

    def __post_init__(self) -> None:
        if self.bits not in (2, 4, 8):
            raise ValueError(f"bits={self.bits} is not supported: use bits=2, bits=4 or bits=8")
        if self.block < 1:
            raise ValueError(f"block={self.block} must be >= 1: use e.g. block=256")


@register("intk")
class IntK(KeyCounters, Compressor):
    collective = "allgather"
    schemes = ("allgather", "twophase")
    biased = False
    description = "block-wise absmax int2/4/8 + fp32 scale per block, stochastic rounding (ZeRO++ qgZ)"
    Config = IntKConfig
    host_syncs = "compress reads a digest of the gradient on the host to seed its rounding stream"

    def __init__(self, config: IntKConfig | None = None) -> None:
        super().__init__(config)
        self.counters: dict[str, int] = {}

    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, tuple[torch.Size, torch.dtype]]:
        flat = tensor.detach().reshape(-1)
        n, block, L = flat.numel(), self.config.block, (1 << (self.config.bits - 1)) - 1
        x = empty(-(-n // block) * block, torch.float32, flat.device)  # a copy: the input is untouched
        x[:n].copy_(flat)
        x[n:].zero_()
        scale = (x := x.view(-1, block)).abs().amax(1)  # NaN or inf where the block is not finite
        step = self.next_count(key)
        digest = int(x.view(torch.int32).sum(dtype=torch.int32))  # wraps mod 2^32: still exact
        h = hashlib.blake2b(f"{self.config.seed}/{key}/{step}/{digest}".encode(), digest_size=8).digest()
        g = torch.Generator(device=x.device).manual_seed(int.from_bytes(h, "little") >> 1)
        y = x.div_(torch.where(scale > 0, scale, 1.0).unsqueeze(1)).mul_(L)  # in [-L, L]
        y.add_(torch.empty_like(y).uniform_(L, L + 1, generator=g))  # y + L + u, u ~ U[0, 1)
        codes = y.nan_to_num_(float(L)).clamp_(0, 2 * L).view(-1)[:n].to(torch.uint8)  # floor; NaN: q = 0
        return (pack_codes(codes, self.config.bits), scale), (tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: tuple[torch.Size, torch.dtype]) -> Tensor:
        (packed, scale), (shape, dtype) = payload, ctx
        n, block, L = numel_of(shape), self.config.block, (1 << (self.config.bits - 1)) - 1
        out = empty(scale.numel() * block, torch.float32, packed.device)
        out[:n].copy_(unpack_codes(packed, n, self.config.bits))
        out = out.view(-1, block).sub_(L).div_(L).mul_(scale.unsqueeze(1))  # (q / L) * scale
        return out.view(-1)[:n].to(dtype).view(shape)

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        return (numel_of(shape) * self.config.bits + 7) // 8 + 4 * -(-numel_of(shape) // self.config.block)
