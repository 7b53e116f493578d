"""``sparseloco``: SparseLoCo's codec (chunked top-k, statistical quantiser, packed indices).

Per tensor (each parameter's own shape; ``per_tensor``), on each rank:

1. chunks of h x w, h and w the largest divisors of the tensor's sides not above ``chunk`` (1-D:
   runs; more dims: the first, then the rest flattened): :func:`~gradzip.compress.indexcode.plan`;
2. the k' = min(k, h w) entries of largest magnitude of each chunk, positions ascending;
3. the tensor's m selected values coded in ``bits`` bits by the bin-mean quantiser (mean shift,
   bins of range·std/2^bits, a table of each bin's mean): :func:`~gradzip.compress.indexcode.quantise`;
4. payload (uint8, uint8, fp32; the bucket's tensors back to back): the positions in 12 bits each
   (``index=pack12``) or the variable-length code (``index=rice``); the codes; the table, shift
   first. Bytes: ceil(12 m / 8) + ceil(bits m / 8) + 4 (2^bits + 1), exact (``fixed_size``); with
   rice the index part varies, ``payload_bytes`` is its bound and the allgather exchanges sizes;
5. ``decompress``: the dense reconstruction (what error feedback subtracts); ``aggregate``: each
   coordinate's mean over the ranks whose decode is nonzero there, i.e. that selected it
   (``aggregate=selected``, SparseLoCo's scatter-mean), or over all ranks (``aggregate=mean``).

With ``ef=true,ef_decay=β``: SparseLoCo's e ← β e + Δ, ĉ = Q(TopK(e)), e ← e − decode(ĉ).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradzip.compress import indexcode
from gradzip.compress.base import Payload, numel_of
from gradzip.compress.fastpaths import BucketCompressor
from gradzip.compress.quantpack import code_bytes, pack_codes, unpack_codes
from gradzip.compress.registry import register


@dataclass
class SparseLoCoConfig:
    chunk: int = 64  # target chunk side: chunks of up to chunk² elements (at most 64: 12-bit positions)
    k: int = 64  # entries sent per chunk
    bits: int = 2  # bits per value code
    range: int = 6  # the quantiser's range, in standard deviations
    index: str = "pack12"  # position code: pack12 (12 bits each) or rice (variable length)
    aggregate: str = "selected"  # mean over the ranks that selected a coordinate, or over all ("mean")

    def __post_init__(self) -> None:
        for name, bad, want in (("chunk", not 1 <= self.chunk <= 64, "in [1, 64] (positions take 12 bits)"),
                                ("k", not 1 <= self.k <= self.chunk ** 2, f"in [1, chunk²] = [1, {self.chunk ** 2}]"),
                                ("bits", not 1 <= self.bits <= 8, "in [1, 8]"), ("range", self.range <= 0, "> 0"),
                                ("index", self.index not in ("pack12", "rice"), "pack12 or rice"),
                                ("aggregate", self.aggregate not in ("selected", "mean"), "selected or mean")):
            if bad:
                raise ValueError(f"{name} must be {want}; got {getattr(self, name)!r}")


@register("sparseloco")
class SparseLoCoCompressor(BucketCompressor):
    collective = "allgather"
    schemes = ("allgather",)
    biased = per_tensor = True
    Config = SparseLoCoConfig
    description = "SparseLoCo: top-k per chunk, 2-bit bin-mean codes, 12-bit or Rice-coded positions"

    def __init__(self, config: SparseLoCoConfig | None = None) -> None:
        super().__init__(config)
        self.fixed_size = self.config.index == "pack12"
        self.host_syncs = "" if self.fixed_size else "index=rice: the code's length is read back"

    def _sizes(self, shape: Sequence[int] | int) -> tuple[tuple[int, int, int, int], int, int]:
        return (p := indexcode.plan(shape, self.config.chunk)), p[0] * p[2], min(self.config.k, p[1] * p[3])

    @torch.no_grad()
    def compress_batch(self, tensors: Sequence[Tensor], key: str = "") -> tuple[Payload, list]:
        parts: list[list[Tensor]] = [[], [], []]
        for t in (t for t in tensors if t.numel()):
            (y, h, x, w), r, k = self._sizes(t.shape)
            blocks = t.detach().float().reshape(y, h, x, w).transpose(1, 2).reshape(r, h * w)
            idx = blocks.abs().topk(k, dim=1, sorted=False).indices.sort(1).values
            codes, table = indexcode.quantise(blocks.gather(1, idx).reshape(-1), self.config.bits, self.config.range)
            parts[0].append(indexcode.encode(idx, h * w, self.config.index))
            parts[1].append(pack_codes(codes, self.config.bits).to(t.device))
            parts[2].append(table)
        dev = tensors[0].device if tensors else None
        empty = [torch.empty(0, dtype=d, device=dev) for d in (torch.uint8, torch.uint8, torch.float32)]
        return tuple(torch.cat([e, *p]) for e, p in zip(empty, parts)), [(t.shape, t.dtype) for t in tensors]

    def decompress_batch(self, payload: Payload, ctx: list) -> list[Tensor]:
        out, at, nb = [], [0, 0, 0], (1 << self.config.bits) + 1
        for shape, dtype in ctx:
            if not numel_of(shape):
                out.append(torch.zeros(shape, dtype=dtype, device=payload[2].device))
                continue
            (y, h, x, w), r, k = self._sizes(shape)
            idx, used = indexcode.decode(payload[0][at[0]:], r, h * w, k, self.config.index)
            nv = code_bytes(r * k, self.config.bits)
            codes = unpack_codes(payload[1][at[1]:at[1] + nv], r * k, self.config.bits).long()
            table = payload[2][at[2]:at[2] + nb]
            values = (table[1:][codes.to(table.device)] + table[0]).view(r, k)
            dense = torch.zeros(r, h * w, device=table.device).scatter_(1, idx.to(table.device), values)
            out.append(dense.view(y, x, h, w).transpose(1, 2).reshape(shape).to(dtype))
            at = [at[0] + used, at[1] + nv, at[2] + nb]
        return out

    def aggregate(self, tensors: list[Tensor]) -> Tensor:
        if self.config.aggregate == "mean":
            return super().aggregate(tensors)
        total, count = tensors[0].float().clone(), (tensors[0] != 0).float()
        for t in tensors[1:]:
            total += t.float()
            count += (t != 0).float()
        return total.div_(count.clamp_(min=1)).to(tensors[0].dtype)

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        if not numel_of(shape):
            return 0
        (_, h, _, w), r, k = self._sizes(shape)
        index = code_bytes(r * k, 12) if self.fixed_size else indexcode.rice_bound(r, h * w, k)
        return index + code_bytes(r * k, self.config.bits) + 4 * ((1 << self.config.bits) + 1)

    def batch_payload_bytes(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32) -> int:
        return sum(self.payload_bytes(s, dtype) for s in shapes)
