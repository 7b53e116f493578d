"""``powersgd``: rank-r compression by one step of power iteration (Vogels, Karimireddy & Jaggi, 2019).

Each tensor is viewed as a matrix M (n, m) = (shape[0], numel // shape[0]) and sent as factors
P (n × r) and Q (m × r): (n + m)·r numbers instead of n·m. Per bucket, in two allreduces:

1. ``compress``: P = M Q, with Q kept from the last step (warm start) or, the first time, normal
   random numbers seeded by (seed, key, shape): equal on every rank, so P is linear in M.
2. allreduce-mean P, which gives (mean M) Q.
3. ``next_round``: P ← an orthonormal basis of P's columns (Householder QR); Q = Mᵀ P.
4. allreduce-mean Q, together with the tensors sent uncompressed.
5. ``decompress``: M̂ = P Qᵀ = P Pᵀ (mean M), the mean gradient projected on span(P); Q is kept.

Error feedback is on by default (``ef=false`` turns it off): each rank keeps M − P Q_localᵀ, what
its own factors did not carry (``residual=local``, the default: the per-rank EF invariant, and the
floats of every committed reproduction). ``residual=reduced`` keeps M − P Q_reducedᵀ as the
authors' code and torch's ``powerSGD_hook`` do: the decode already computes it, so EF costs one
full-size matmul less. Without EF PowerSGD converges poorly.

Tuning:
  * ``rank``: start at 2–4; increase it if the loss lags behind the uncompressed run. Each unit of
    rank costs (n + m)·4 bytes per matrix and one more column in every matmul.
  * ``warm_start``: keep it on. Reusing Q makes successive steps one continued power iteration that
    tracks the top-r subspace of a slowly changing gradient; off, Q is fresh random every step.
  * ``min_compression_rate``: a matrix is compressed only if n·m / ((n + m)·r) reaches it; the rest,
    1-D tensors (biases, LayerNorm) and scalars included, are sent exactly: they save few bytes.

Implementation: same-shape matrices are batched (one ``bmm`` per group, zero-copy where the bucket
layout allows, see :func:`gradzip.compress._linalg.batch_views`). Factors are fp32 whatever the
gradient dtype, so a matrix costs exactly (n + m)·r·4 bytes; uncompressed tensors travel in their
own dtype (fp32 if a bucket mixes dtypes). r is clamped to min(n, m). Inputs must stay unchanged
until ``next_round_batch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradzip.compress._linalg import (
    FactorGroup,
    LowRankCtx,
    batch_views,
    bmm_into,
    bmm_t_into,
    orthonormalize,
    seeded_normal,
)
from gradzip.compress.base import Payload, key_under, numel_of, sub_finite_, unflatten
from gradzip.compress.fastpaths import BucketCompressor, ResidualFromOutput
from gradzip.compress.registry import register


@dataclass
class PowerSGDConfig:
    rank: int = 4
    warm_start: bool = True
    min_compression_rate: float = 2.0
    seed: int = 0
    residual: str = "local"  # error feedback against this rank's factors (local) or the reduced ones

    def __post_init__(self) -> None:
        if self.residual not in ("local", "reduced"):
            raise ValueError(f"residual must be 'local' or 'reduced', got {self.residual!r}")
        if self.rank < 1:
            raise ValueError(f"rank must be an integer >= 1 (typically 1 to 32), got {self.rank}")
        if not self.min_compression_rate >= 0:
            raise ValueError(f"min_compression_rate must be >= 0, got {self.min_compression_rate}")


@register("powersgd")
class PowerSGD(ResidualFromOutput, BucketCompressor):
    collective = "allreduce"
    biased = True
    default_ef = True
    rounds = 2
    per_tensor = True
    Config = PowerSGDConfig
    description = "rank-r factors P, Q by power iteration, warm-started, same-shape batching (Vogels et al. 2019)"

    def __init__(self, config: PowerSGDConfig | None = None) -> None:
        super().__init__(config)
        self.residual_from_output = self.config.residual == "reduced"
        self._q: dict[str, Tensor] = {}  # state key -> reduced Q of the last step (B, m, r)
        self._steps: dict[str, int] = {}  # state key -> steps taken (seeds a fresh random Q)

    def _matrix(self, shape: Sequence[int] | int) -> tuple[int, int, int] | None:
        """(n, m, r) if a tensor of this shape is compressed, else None."""
        if isinstance(shape, int) or len(shape) < 2 or numel_of(shape) == 0:
            return None
        n, m = int(shape[0]), numel_of(shape) // int(shape[0])
        r = min(self.config.rank, n, m)
        return (n, m, r) if n * m >= self.config.min_compression_rate * (n + m) * r else None

    @torch.no_grad()
    def compress_batch(self, tensors: Sequence[Tensor], key: str = "") -> tuple[Payload, Any]:
        device = tensors[0].device if tensors else torch.device("cpu")
        by_shape: dict[tuple[int, int, int], list[int]] = {}
        plain: list[int] = []
        for i, t in enumerate(tensors):
            dims = self._matrix(t.shape)
            (by_shape.setdefault(dims, []) if dims else plain).append(i)
        uncompressed = torch.cat([tensors[i].reshape(-1) for i in plain]) if plain else torch.empty(0, device=device)
        ctx = LowRankCtx([t.shape for t in tensors], [t.dtype for t in tensors], [], plain, uncompressed)
        for (n, m, r), idx in by_shape.items():
            skey = f"{key}/{n}x{m}"
            step = self._steps[skey] = self._steps.get(skey, 0) + 1
            q = self._q.get(skey) if self.config.warm_start else None
            if q is None or q.shape != (len(idx), m, r):  # one start for all members: batching-invariant
                q = seeded_normal((m, r), self.config.seed, skey, step).expand(len(idx), m, r)
            mats = batch_views([tensors[i] for i in idx], n, m)
            ctx.groups.append(FactorGroup(n, m, r, idx, skey, q.to(device), mats))
        p_flat, ps = ctx.views(None, "p")
        for g, p in zip(ctx.groups, ps):
            for sel, mats in g.runs:
                bmm_into(p, sel, mats, g.q[sel])
        return (p_flat,), ctx

    @torch.no_grad()
    def next_round_batch(self, reduced: Payload, ctx: LowRankCtx) -> tuple[Payload, Any]:
        q_flat, qs = ctx.views(None, "q")
        for g, p, q in zip(ctx.groups, ctx.views(reduced[0], "p")[1], qs):
            g.p = orthonormalize(p)
            for sel, mats in g.runs:
                bmm_t_into(q, sel, mats, g.p[sel])  # Q = Mᵀ P
            g.runs = []  # release the matrices
        return (q_flat, ctx.uncompressed), ctx

    @torch.no_grad()
    def decompress_batch(self, payload: Payload, ctx: LowRankCtx) -> list[Tensor]:
        out: list[Tensor] = [torch.empty(0)] * len(ctx.shapes)
        for i, t in zip(ctx.plain, unflatten(payload[1], [ctx.shapes[i] for i in ctx.plain])):
            out[i] = t
        for g, q in zip(ctx.groups, ctx.views(payload[0], "q")[1]):
            if self.config.warm_start:  # the last call sees the reduced Q, equal on all ranks. A step
                # with inf/NaN gradients (skipped by a GradScaler) must not poison every later step.
                self._q[g.skey] = torch.nan_to_num(q, nan=0.0, posinf=0.0, neginf=0.0)
            approx = torch.bmm(g.p, q.transpose(1, 2))
            for k, i in enumerate(g.idx):
                out[i] = approx[k].view(ctx.shapes[i])
        return [o.to(d) for o, d in zip(out, ctx.dtypes)]


    def subtract_output(self, out: list[Tensor], ctx: LowRankCtx, memory: list[Tensor]) -> bool:
        for i in ctx.plain:  # sent exactly: nothing is left behind (x − x is +0, or NaN that EF zeroes)
            memory[i].zero_()
        return all([sub_finite_(memory[i], out[i]) for g in ctx.groups for i in g.idx])

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        dims = self._matrix(shape)
        if dims is None:  # sent uncompressed
            return numel_of(shape) * torch.empty((), dtype=dtype).element_size()
        n, m, r = dims
        return (n + m) * r * 4

    def batch_payload_bytes(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32) -> int:
        return sum(self.payload_bytes(s, dtype) for s in shapes)

    def forget(self, key: str) -> None:
        for d in (self._q, self._steps):
            for k in [k for k in d if key_under(k, key)]:
                del d[k]

    def state_dict(self) -> dict[str, Any]:
        return {"q": {k: v.clone() for k, v in self._q.items()}, "steps": dict(self._steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) - {"q", "steps"}:
            raise ValueError(f"powersgd: unexpected state keys {sorted(state)}; expected 'q' and 'steps'")
        self._q = {k: v.clone() for k, v in state.get("q", {}).items()}
        self._steps = {k: int(v) for k, v in state.get("steps", {}).items()}
