"""``randomk``: send k = ceil(ratio * n) entries at indices every rank draws from a shared seed.

Algorithm, per tensor and step (Stich et al. 2018; Wangni et al. 2018):

1. A generator is seeded from (``seed``, ``key``, this key's call counter) by a hash that is the
   same in every process, so all ranks draw the same indices and the counter makes every step's
   draw new. The counter is the compressor's state: a resumed run draws the same indices.
2. k distinct indices, uniform without replacement: k + margin integers are drawn, duplicates
   removed, and a random k of the distinct ones kept (randperm(n) instead once k >= n/4). Sorted.
3. Payload: the k values only (the indices are not sent): k * itemsize bytes. Because every rank
   picked the same indices, the payloads are summed by a plain allreduce.
4. Decompress: scatter into zeros, scaled by n/k when ``unbiased`` (so E[output] = gradient). The
   scaling happens after the reduction, so fp16 payloads cannot overflow on the wire.

``biased``: the class attribute describes the default config (``unbiased=true``: not biased); an
instance's ``biased`` attribute follows its own config. Tuning: the unbiased estimator's variance
grows like n/k, so small ratios slow convergence a lot without error feedback; with EF use
``unbiased=false`` (scaling the transmitted part by n/k makes the EF residual blow up).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradzip.compress.base import Compressor, KeyCounters, Payload, numel_of
from gradzip.compress.registry import register
from gradzip.compress.select import sparse_to_dense
from gradzip.compress.topk import check_ratio, k_of


@dataclass
class RandomKConfig:
    ratio: float = 0.01  # fraction of entries sent; 0 < ratio <= 1
    seed: int = 0  # must be equal on all ranks
    unbiased: bool = True  # scale by n/k so that E[output] = input

    def __post_init__(self) -> None:
        check_ratio(self.ratio)


@dataclass(frozen=True)
class _Ctx:
    shape: torch.Size
    dtype: torch.dtype
    indices: Tensor  # int64, identical on every rank
    scale: float


@register("randomk")
class RandomK(KeyCounters, Compressor):
    collective = "allreduce"
    schemes = ("allreduce", "twophase")
    biased = False  # for the default unbiased=true; see __init__
    description = "random-k: ratio*n entries at indices from a seed shared by all ranks (allreduce)"
    Config = RandomKConfig

    def __init__(self, config: RandomKConfig | None = None) -> None:
        super().__init__(config)
        self.biased = not self.config.unbiased
        self.counters: dict[str, int] = {}

    def ef_caveat(self) -> str | None:
        if self.config.unbiased:
            return ("unbiased=true scales the kept entries by n/k, which is not a contraction: error feedback "
                    "then diverges; use unbiased=false with ef=true")
        return None

    def indices(self, n: int, key: str) -> Tensor:
        """This step's sorted int64 indices for ``key`` (advances the key's counter)."""
        step = self.next_count(key)
        k = k_of(self.config.ratio, n)
        digest = hashlib.blake2b(f"{self.config.seed}/{key}/{step}".encode(), digest_size=8).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
        if 4 * k >= n:  # also n == 0
            return torch.randperm(n, generator=g)[:k].sort().values
        distinct = torch.empty(0, dtype=torch.int64)
        draw = k + 2 * k * k // n + 64  # expected duplicates ~ k^2 / 2n
        while distinct.numel() < k:  # rarely more than once
            distinct = torch.cat([distinct, torch.randint(n, (draw,), generator=g)]).unique()
        keep = torch.randperm(distinct.numel(), generator=g)[:k]
        return distinct[keep].sort().values

    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, _Ctx]:
        flat = tensor.detach().reshape(-1)
        n = flat.numel()
        idx = self.indices(n, key).to(flat.device)
        scale = n / idx.numel() if self.config.unbiased and idx.numel() else 1.0
        return (flat[idx],), _Ctx(tensor.shape, tensor.dtype, idx, scale)

    def decompress(self, payload: Payload, ctx: _Ctx) -> Tensor:
        values = payload[0].to(ctx.dtype)
        if ctx.scale != 1.0:
            values = values * ctx.scale
        return sparse_to_dense(values, ctx.indices, numel_of(ctx.shape)).view(ctx.shape)

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        return k_of(self.config.ratio, numel_of(shape)) * torch.empty((), dtype=dtype).element_size()

