"""``int8bins``: 256 uniform bins over mean ± 6σ, each element sent as its 1-byte bin index and
decoded to the mean of the values that fell in its bin (INTELLECT-1's int8 pseudo-gradients).

Algorithm (Jaghouar et al. 2024, "INTELLECT-1 Technical Report", arXiv 2412.01152), per flat
tensor x of n elements (fp32, fp16 or bf16; computed in fp32), with k = ``sigmas``:

1. y = x / max|x| (in [-1, 1]: no fp32 overflow), μ = mean(y) and σ = std(y) (population, two
   passes: no cancellation), in fp32.
2. 256 bins of width w = 2kσ/256 over [μ − kσ, μ + kσ): code = floor((y − μ)/w + 128), clamped
   to [0, 255] (values beyond μ ± kσ go to the end bins). Codes grow with x: a bin is an interval.
3. Per bin, the mean of the values x that fell in it (fp64 sums, exact counts), sent as fp32; a
   bin nobody fell in holds 0.
4. Payload: the codes (uint8) and the 256 fp32 bin means: exactly n + 1024 bytes, fixed size
   (~4x smaller than fp32 for large n; the 1 KiB per bucket matters below ~100k elements).
5. Each rank's payload is allgathered (the ranks' bin means differ: codes cannot be summed);
   every rank decodes means[code] in the tensor's dtype and averages, in one pass.

Error: a value inside μ ± kσ decodes to a point of its own bin, so |error| < w = σ/21 at k = 6; the
end bins' means mix the outliers with their neighbours (beyond ±6σ: ~2e-9 of a Gaussian tensor).
Per bin the errors sum to zero: the tensor's sum survives up to fp32 rounding. Biased (deterministic
rounding): ``ef=true`` is allowed, off by default as for ``fp8`` and the casts, whose per-element
error is likewise small next to SGD's noise (``onebit`` and PowerSGD default to error feedback
because they stall without it). Collective: allgather, and ``twophase`` (a chunk's payload decodes
with any rank's context of its size). No state, no randomness.
Exact cases: zeros decode to zeros, a constant tensor to its constant (one bin; its fp64 sum is
exact below 2^29 elements); an empty tensor sends 256 zero means. Non-finite input: an inf or NaN
anywhere makes all 256 means NaN, so the tensor decodes to NaN entirely (the engine's non-finite
step skipping catches it); never full precision instead.
Tuning: a smaller ``sigmas`` gives finer bins for the bulk but clips more values into the end
bins. One μ and σ per bucket: a smaller ``bucket_cap_mb`` gives layers bins of their own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradzip.compress.base import Compressor, Payload, numel_of
from gradzip.compress.fastpaths import DecodeAggregate, SubtractSent
from gradzip.compress.registry import register

BINS = 256
CHUNK = 1 << 16  # elements per step of the loops: their temporaries stay in cache
Ctx = tuple[torch.Size, torch.dtype]


@dataclass
class Int8BinsConfig:
    sigmas: float = 6.0  # half-width of the binned range, in standard deviations; > 0

    def __post_init__(self) -> None:
        if not (isinstance(self.sigmas, (int, float)) and 0 < self.sigmas < math.inf):
            raise ValueError(f"sigmas must be a finite number > 0, e.g. sigmas=6.0; got {self.sigmas!r}")


@register("int8bins")
class Int8Bins(DecodeAggregate, SubtractSent, Compressor):
    collective = "allgather"
    schemes = ("allgather", "twophase")
    biased = True
    description = "uint8 index of 256 bins over mean±sigmas·σ + 256 fp32 bin means; decodes to bin means (INTELLECT-1)"
    Config = Int8BinsConfig
    host_syncs = "torch.bincount reads the codes' maximum on the host to size its output"

    @torch.no_grad()
    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, Ctx]:
        x = tensor.detach().reshape(-1).float()  # not modified: a view when already fp32
        if (n := x.numel()) == 0:  # nothing to bin: no codes, 256 zero means
            return (x.to(torch.uint8), x.new_zeros(BINS)), (tensor.shape, tensor.dtype)
        amax = torch.stack(x.aminmax()).abs().amax()  # max |x|; NaN if any NaN
        y = x / torch.where(amax > 0, amax, 1.0)  # in [-1, 1]: fp32 squares never overflow
        mean = y.sum() / n
        finite = torch.isfinite(mean)  # false if any inf or NaN; no host sync
        sd = torch.linalg.vector_norm(y.sub_(mean)) / math.sqrt(n)  # two passes: no cancellation
        # bins per unit of y − μ, capped: σ = 0 (a constant) must not give 0 · inf = NaN
        scale = (BINS / 2 / (self.config.sigmas * sd)).clamp(max=torch.finfo(torch.float32).max)
        codes = y.mul_(scale).add_(BINS // 2).nan_to_num_(BINS // 2).clamp_(0, BINS - 1).to(torch.uint8)  # floor
        sums = torch.zeros(BINS, dtype=torch.float64, device=x.device)
        for c, v in zip(codes.split(CHUNK), x.split(CHUNK)):  # fp64 sums, one chunk at a time
            sums += torch.bincount(c, weights=v.double(), minlength=BINS)
        counts = torch.bincount(codes, minlength=BINS)
        means = torch.where(counts > 0, sums / counts, 0.0).float().where(finite, math.nan)
        return (codes, means), (tensor.shape, tensor.dtype)

    def _sum(self, payloads: list[Payload], ctx: Ctx) -> Tensor:
        """Σ over ranks of means[codes] in ``ctx``'s dtype, chunk by chunk, in rank order: the
        floats of decoding each payload and adding the tensors (Compressor.aggregate)."""
        shape, dtype = ctx
        n, tables = numel_of(shape), [p[1].to(dtype) for p in payloads]
        out = torch.empty(n, dtype=dtype, device=payloads[0][0].device)
        for start in range(0, n, CHUNK):
            acc, end = out[start:start + CHUNK], start + CHUNK
            torch.index_select(tables[0], 0, payloads[0][0][start:end].to(torch.int32), out=acc)
            for table, (codes, _) in zip(tables[1:], payloads[1:]):
                acc += torch.index_select(table, 0, codes[start:end].to(torch.int32))
        return out

    @torch.no_grad()
    def decompress(self, payload: Payload, ctx: Ctx) -> Tensor:
        return self._sum([payload], ctx).view(ctx[0])

    @torch.no_grad()
    def decode_aggregate(self, payloads: list[Payload], ctx: Ctx) -> Tensor | None:
        if type(self).aggregate is not Compressor.aggregate:
            return None  # a subclass that combines the ranks otherwise
        return self._sum(payloads, ctx).div_(len(payloads)).view(ctx[0])

    @torch.no_grad()
    def subtract_sent(self, payload: Payload, ctx: Ctx, flat: Tensor) -> bool:
        codes, means = payload
        if ctx[1] != torch.float32 or flat.dtype != torch.float32 or flat.numel() != codes.numel():
            return False
        for start in range(0, codes.numel(), CHUNK):  # flat −= means[codes], no full-size decode
            flat[start:start + CHUNK] -= torch.index_select(means, 0, codes[start:start + CHUNK].to(torch.int32))
        return True

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        return numel_of(shape) + 4 * BINS
