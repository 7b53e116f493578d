"""``distro``: DisTrO as Psyche ships it (``PsycheFoundation/psyche``, ``shared/modeling/src/distro.rs``).

DeMo's momentum and DCT (:mod:`gradzip.compress.demo`) with Psyche's chunking, wire, mean and error
timing. Per tensor and call, on each rank (g: lr·(local gradient) from ``--optimizer demo``):

1. δ ← decay·(δ − T) + g, T the inverse DCT of what the *previous* call sent, in full precision: like
   Psyche, whose exchange overlaps the next step, δ loses what it sent one call late (non-finite g
   entries count as 0; the engine skips such steps and undoes δ and T);
2. the 2-D DCT-II of δ over chunks whose sides are the largest divisors of the rows and columns not
   above ``chunk`` (:func:`gradzip.compress.dct.divisor_plan`), top-k per chunk; T ← their inverse DCT;
3. payload: the indices inside the chunk, u8 (chunks of <= 256) or u16 (64 × 64) little-endian; then
   each tensor's sign bits (1: negative, -0.0 too), 8 per byte from the least significant bit, padded
   to a byte. No scale or magnitude travels: K·w + ceil(K/8) bytes for K = Σ_chunks min(topk, a·b);
4. allgather; every coefficient is averaged over the ranks that sent it (Psyche's scatter mean of
   ±1s, sums in rank order) and one inverse DCT taken. The sign step is the optimizer's.

``decompress`` gives a rank's ±1 coefficients (block-major, in the tensor's shape and dtype);
``aggregate`` equals ``decode_aggregate`` bit for bit. T is kept in ``state`` under ``sent:KEY/i``;
the error memory (``residuals``) is δ − T.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from gradzip.compress import bitpack, dct
from gradzip.compress.base import Payload
from gradzip.compress.demo import DeMoCompressor, DeMoConfig, _Ctx
from gradzip.compress.quantpack import code_bytes, pack_codes
from gradzip.compress.registry import register


@dataclass
class DistroConfig(DeMoConfig):
    topk: int = 8  # coefficients sent per chunk (Psyche's shipped run: topk 8, chunk 64, decay 0.999)


@register("distro")
class DistroCompressor(DeMoCompressor):
    Config = DistroConfig
    description = ("DisTrO as Psyche sends it: DeMo's δ and chunked DCT, top-k per chunk as u8/u16 indices and "
                   "1-bit signs; mean over the ranks that sent each coefficient")

    def _plan(self, shape: Sequence[int] | int) -> dct.Plan:
        dims = (int(shape),) if isinstance(shape, int) else tuple(int(d) for d in shape)
        return dct.divisor_plan(dims, self.config.chunk, self.config.topk)

    @torch.no_grad()
    def compress_batch(self, tensors: Sequence[Tensor], key: str = "") -> tuple[Payload, _Ctx]:
        ctx = _Ctx([t.shape for t in tensors], [t.dtype for t in tensors])
        codes, signs = [torch.empty(0, dtype=torch.uint8)], [torch.empty(0, dtype=torch.uint8)]
        for i, t in enumerate(tensors):
            k, pl = f"{key}/{i}", self._plan(t.shape)
            delta = torch.nan_to_num(t.detach().float().reshape(-1), nan=0.0, posinf=0.0, neginf=0.0)
            old, sent = self.state.get(k), self.state.get(f"sent:{k}")
            if old is not None and old.shape == delta.shape:
                old = old.to(delta.device) - (0.0 if sent is None else sent.to(delta.device))
                delta = old.mul_(self.config.decay).add_(delta)  # Psyche's order: subtract, decay, add lr·g
            coeffs = dct.forward(delta.view(pl.rows, pl.cols), pl)
            local, where = dct.top_per_chunk(coeffs, pl)
            values = coeffs[where]
            self.state[k] = delta
            self.state[f"sent:{k}"] = dct.inverse(torch.zeros_like(coeffs).index_put_((where,), values), pl).view(-1)
            codes.append(pack_codes(local, pl.bits))
            signs.append(bitpack.pack_signs(values))
        device = tensors[0].device if tensors else torch.device("cpu")
        return (torch.cat([c.to(device) for c in codes]), torch.cat([s.to(device) for s in signs])), ctx

    def _sums(self, payloads: list[Payload], ctx: _Ctx) -> list[tuple[Tensor, Tensor]]:
        """Per tensor: the ranks' ±1 coefficients added in rank order, and how many ranks sent each."""
        plans, dev = [self._plan(s) for s in ctx.shapes], payloads[0][1].device
        out = [(torch.zeros(s.numel(), device=dev), torch.zeros(s.numel(), device=dev)) for s in ctx.shapes]
        for packed, sign_bytes in payloads:
            ends = list(accumulate((bitpack.packed_numel(pl.kept) for pl in plans), initial=0))
            values = torch.cat([torch.empty(0, device=dev)] + [bitpack.unpack_signs(sign_bytes[a:b], pl.kept, 1.0,
                               torch.float32) for a, b, pl in zip(ends, ends[1:], plans)])
            dct.add_payload(packed, values, plans, [s for s, _ in out])
            dct.add_payload(packed, torch.ones_like(values), plans, [n for _, n in out])
        return out

    def decompress_batch(self, payload: Payload, ctx: _Ctx) -> list[Tensor]:
        return [s.view(shape).to(d) for (s, _), shape, d in zip(self._sums([payload], ctx), ctx.shapes, ctx.dtypes)]

    def aggregate(self, tensors: list[Tensor]) -> Tensor:
        total, count = tensors[0].float().reshape(-1).clone(), (tensors[0] != 0).float().reshape(-1)
        for t in tensors[1:]:
            total += t.float().reshape(-1)
            count += (t != 0).float().reshape(-1)
        return self._mean_inverse(total, count.clamp_(min=1), tensors[0].shape, tensors[0].dtype)

    def decode_aggregate_batch(self, payloads: list[Payload], ctx: _Ctx) -> list[Tensor] | None:
        return [self._mean_inverse(t, n.clamp_(min=1), s, d)
                for (t, n), s, d in zip(self._sums(payloads, ctx), ctx.shapes, ctx.dtypes)]

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        pl = self._plan(shape)
        return code_bytes(pl.kept, pl.bits) + bitpack.packed_numel(pl.kept)

    def forget(self, key: str) -> None:
        super().forget(key)
        super().forget(f"sent:{key}")

    def residuals(self, key: str) -> list[Tensor] | None:
        mine = super().residuals(key)
        return None if mine is None else [d - self.state.get(f"sent:{key}/{i}", 0.0) for i, d in enumerate(mine)]
