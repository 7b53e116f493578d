"""``demo``: DeMo's compressor (Peng, Quesnelle & Kingma 2024, "Decoupled Momentum Optimization").

Per tensor and step, on each rank (g: the input, lr·(local gradient) from the DeMo optimizer,
:mod:`gradzip.optim.demo`; δ: fp32 state per key, a new tensor each step):

1. δ ← decay·δ + g, non-finite entries of g taken as 0 (the engine skips such steps and undoes δ);
2. the chunked 2-D DCT-II of δ (orthonormal; chunk × chunk, an axis's last chunk the rest, no
   padding; 1-D tensors in 1-D chunks: :mod:`gradzip.compress.dct`);
3. payload: each chunk's top-k coefficients by magnitude: indices inside the chunk in b bits
   (enough for the tensor's largest chunk: 12 for 64²) + values in the tensor's dtype;
4. δ ← δ − inverse DCT of the values as sent: error feedback, so ``ef=`` is ignored (``own_ef``);
5. allgather (fixed size); each rank adds the coefficients in rank order into one fp32 vector,
   divides by the world size and takes one inverse DCT: the same floats on every rank.

``decompress`` gives a rank's coefficients (block-major, in the tensor's shape and dtype), not a
gradient; ``aggregate`` is step 5, equal to ``decode_aggregate`` bit for bit. Bytes of a tensor,
with K = Σ over its chunks of min(topk, chunk size) and s the dtype's size: ceil(K·b/8) + K·s (a
bucket: the sum over its tensors). topk ≥ chunk² is lossless up to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradzip.compress import dct
from gradzip.compress.base import Payload, ReplacedState
from gradzip.compress.fastpaths import BucketCompressor, DecodeAggregate
from gradzip.compress.registry import register


@dataclass
class DeMoConfig:
    topk: int = 32  # coefficients sent per chunk
    chunk: int = 64  # chunk side (indices take up to 16 bits: at most 256)
    decay: float = 0.999  # δ's decay per step

    def __post_init__(self) -> None:
        for name, bad, want in (("topk", self.topk < 1, ">= 1, e.g. 32"), ("chunk", not 1 <= self.chunk <= 256,
                                "in [1, 256], e.g. 64"), ("decay", not 0 <= self.decay <= 1, "in [0, 1], e.g. 0.999")):
            if bad:
                raise ValueError(f"{name} must be {want}; got {getattr(self, name)!r}")


@dataclass(frozen=True)
class _Ctx:
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]


@register("demo")
class DeMoCompressor(DecodeAggregate, ReplacedState, BucketCompressor):
    collective = "allgather"
    schemes = ("allgather",)
    biased = True
    per_tensor = True
    own_ef = True
    state_key = "delta"
    Config = DeMoConfig
    description = "DeMo: momentum δ, chunked 2-D DCT, top-k per chunk, bit-packed indices; δ keeps the rest"

    def __init__(self, config: DeMoConfig | None = None) -> None:
        super().__init__(config)
        self.state: dict[str, Tensor] = {}  # f"{key}/{i}" -> δ of the bucket's tensor i (flat, fp32)

    def _plan(self, shape: Sequence[int] | int) -> dct.Plan:
        dims = (int(shape),) if isinstance(shape, int) else tuple(int(d) for d in shape)
        return dct.plan(dims, self.config.chunk, self.config.topk)

    @torch.no_grad()
    def compress_batch(self, tensors: Sequence[Tensor], key: str = "") -> tuple[Payload, _Ctx]:
        ctx = _Ctx([t.shape for t in tensors], [t.dtype for t in tensors])
        wire = ctx.dtypes[0] if len(set(ctx.dtypes)) == 1 else torch.float32  # a bucket has one dtype
        codes, values = [torch.empty(0, dtype=torch.uint8)], [torch.empty(0, dtype=wire)]
        for i, t in enumerate(tensors):
            pl, old = self._plan(t.shape), self.state.get(f"{key}/{i}")
            delta = torch.nan_to_num(t.detach().float().reshape(-1), nan=0.0, posinf=0.0, neginf=0.0)
            if old is not None and old.shape == delta.shape:
                delta.add_(old.to(delta.device), alpha=self.config.decay)
            packed, sent = dct.send_top(delta.view(pl.rows, pl.cols), pl, wire)  # δ -= inverse DCT of what is sent
            self.state[f"{key}/{i}"] = delta
            codes.append(packed)
            values.append(sent)
        device = tensors[0].device if tensors else torch.device("cpu")
        return (torch.cat([c.to(device) for c in codes]), torch.cat([v.to(device) for v in values])), ctx

    def _sum(self, payloads: list[Payload], ctx: _Ctx) -> list[Tensor]:
        """The ranks' coefficients added in rank order, one fp32 block-major vector per tensor (each
        its own allocation: a tensor decodes to the same floats whatever bucket it is in)."""
        totals = [torch.zeros(s.numel(), dtype=torch.float32, device=payloads[0][1].device) for s in ctx.shapes]
        for p in payloads:
            dct.add_payload(*p, [self._plan(s) for s in ctx.shapes], totals)
        return totals

    def decompress_batch(self, payload: Payload, ctx: _Ctx) -> list[Tensor]:
        return [c.view(s).to(d) for c, s, d in zip(self._sum([payload], ctx), ctx.shapes, ctx.dtypes)]

    def aggregate(self, tensors: list[Tensor]) -> Tensor:
        total = tensors[0].float().reshape(-1).clone()
        for t in tensors[1:]:
            total += t.float().reshape(-1)
        return self._mean_inverse(total, len(tensors), tensors[0].shape, tensors[0].dtype)

    def _mean_inverse(self, total: Tensor, n: int | Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        return dct.inverse(total.div_(n), self._plan(shape)).view(shape).to(dtype)

    def decode_aggregate_batch(self, payloads: list[Payload], ctx: _Ctx) -> list[Tensor] | None:
        sums = zip(self._sum(payloads, ctx), ctx.shapes, ctx.dtypes)
        return [self._mean_inverse(t, len(payloads), s, d) for t, s, d in sums]

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        return dct.nbytes(self._plan(shape), torch.empty((), dtype=dtype).element_size())

    def batch_payload_bytes(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32) -> int:
        return sum(self.payload_bytes(s, dtype) for s in shapes)
