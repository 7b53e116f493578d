"""``bf16``: cast the gradient to bfloat16 for the allreduce, and back.

Same algorithm and contract as :mod:`gradzip.compress.fp16` (payload = the flat gradient in bf16,
2 bytes per element, aliasing the gradient when it is already bf16; decompress casts back).

bf16 has fp32's exponent range, so it does not overflow where fp32 would not, but only 8 bits of
mantissa: relative rounding error up to 2^-8. ``biased = True`` in the strict sense (deterministic
round-to-nearest); in practice the error is below SGD's noise. Tuning: prefer bf16 over fp16 when
gradients can be large (no loss scaling). ``ef=true`` removes the rounding bias of each rank's own
cast, per rank only: with 2 or more workers the averaged result is rounded to bf16 again by the
reduction, outside every rank's error feedback.
"""

from __future__ import annotations

import torch

from gradzip.compress.fp16 import Cast
from gradzip.compress.registry import register


@register("bf16")
class BF16(Cast):
    wire_dtype = torch.bfloat16
    description = "cast to bfloat16 for the allreduce (2 bytes/element; fp32's range, 8-bit mantissa)"
