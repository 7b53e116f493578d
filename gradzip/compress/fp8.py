"""``fp8``: 8-bit floating point (E4M3 or E5M2) with one fp32 scale per tensor.

Algorithm (the FP8 formats of Micikevicius et al. 2022, "FP8 Formats for Deep Learning", used for
gradients with a per-tensor scale as in FP8 training recipes), per tensor:

1. scale = max|g| / FMAX (fp32), with FMAX the format's largest finite value (448 for E4M3,
   57344 for E5M2), so that the largest entry lands on the format's largest value.
2. Each element becomes ``(g / scale)`` cast to the 8-bit float, rounding to nearest even.
3. Payload: the codes (1 byte each) and the fp32 scale: n + 4 bytes, 4× smaller than fp32.
4. Each rank's payload is allgathered (ranks' scales differ, so codes cannot be summed) and every
   rank decodes code · scale and averages.

Biased (round to nearest); relative error per element ≤ 2⁻⁴ (E4M3) or 2⁻³ (E5M2) for values within
the format's normal range, while entries below max|g| · 2⁻⁹ (E4M3) lose precision or flush to
zero: use it with error feedback (``fp8:ef=true``) or where a few-percent error per step is
harmless. E4M3 (the default) has more mantissa; E5M2 more range, for heavy-tailed gradients. Zero
tensors give scale 0 and zeros; an inf or NaN makes the scale non-finite and the tensor decodes
to NaN, which the engine's non-finite step skipping catches. No state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradzip.compress.base import Compressor, Payload, numel_of
from gradzip.compress.registry import register

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass
class FP8Config:
    format: str = "e4m3"  # e4m3 (more precision) or e5m2 (more range)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format must be e4m3 or e5m2, got {self.format!r}")


@dataclass(frozen=True)
class _Ctx:
    shape: torch.Size
    dtype: torch.dtype


@register("fp8")
class FP8(Compressor):
    collective = "allgather"
    schemes = ("allgather", "twophase")
    biased = True
    Config = FP8Config
    description = "8-bit float codes (E4M3 or E5M2) + one fp32 scale max|g|/FMAX per tensor (FP8 formats)"

    @torch.no_grad()
    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, _Ctx]:
        fmt = FORMATS[self.config.format]
        flat = tensor.detach().reshape(-1).float()
        amax = flat.abs().max() if flat.numel() else flat.new_zeros(())
        scale = (amax / torch.finfo(fmt).max).reshape(1)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a zero tensor: codes 0, scale 0
        codes = (flat / safe).to(fmt).view(torch.uint8)
        return (codes, scale), _Ctx(tensor.shape, tensor.dtype)

    @torch.no_grad()
    def decompress(self, payload: Payload, ctx: _Ctx) -> Tensor:
        codes, scale = payload
        fmt = FORMATS[self.config.format]
        out = codes.view(fmt).float() * scale
        # A non-finite input never decodes as finite numbers; a select, not a branch: no host sync.
        out = torch.where(torch.isfinite(scale), out, float("nan"))
        return out.to(ctx.dtype).view(ctx.shape)

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        return numel_of(shape) + 4
