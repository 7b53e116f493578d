"""``dgc``: Deep Gradient Compression (Lin et al., ICLR 2018), per key (the bucket, flat; fp32 state):

1. g = the gradient, non-finite entries zeroed (NaN/inf never enter the state). Local clipping
   (``clip > 0``): g *= clip / ||g||_2 if ||g||_2 > clip, the norm of the whole bucket (what the
   compressor gets). The paper clips each of N workers at the global threshold / sqrt(N); a bucket
   with a fraction f of the squared norm takes clip = threshold * sqrt(f / N).
2. Momentum correction: u = momentum * u + g; v = v + u.
3. Warm-up (step s counted per key): density = warmup_ratio * (ratio / warmup_ratio) ** (s /
   warmup_steps) while s < warmup_steps, then ``ratio`` (the paper: 25% to 0.1% over 4 epochs).
4. Payload: exact top-k of |v|, k = max(1, ceil(density * n)), values in the gradient's dtype
   (saturating) + int32 indices: k * (itemsize + 4) bytes. ``payload_bytes`` is the steady state
   (k for ``ratio``), exact after warm-up and with ``warmup_steps=0`` (the default); during warm-up
   the size changes every step (the same on every rank) and the instance has ``fixed_size = False``.
5. Momentum factor masking: u = 0, v -= sent at the k indices (0, but for fp16/bf16 rounding).
6. Allgather, scatter into zeros, average over ranks.

Biased (top-k), but v keeps all that was not sent: its own error memory, so it converges without
EF (``default_ef = False``; ``ef=true`` adds a second memory, not needed). Use plain SGD outside,
with momentum SGD's learning rate (momentum SGD on top applies momentum twice); with AdamW prefer
``momentum=0`` (Adam's moments see sparse, delayed entries). Tuning: ratio 0.001-0.01, warm-up a
few epochs. ``residuals`` is v, flat; after DDP's bucket rebuild u and the warm-up counter restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradzip.compress.base import Compressor, Payload, cast_saturating, flatten, key_under
from gradzip.compress.registry import register
from gradzip.compress.select import topk_indices
from gradzip.compress.topk import TopK, _Ctx, check_ratio, k_of


@dataclass
class DGCConfig:
    ratio: float = 0.001  # steady-state fraction of entries sent; 0 < ratio <= 1
    momentum: float = 0.9  # 0 <= momentum < 1; the optimizer outside should have none
    clip: float = 0.0  # L2-norm threshold per bucket; 0: no clipping
    warmup_steps: int = 0  # steps (per key) of exponentially decreasing density; 0: none
    warmup_ratio: float = 0.25  # density of the first warm-up step; 0 < warmup_ratio <= 1

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be 0 <= momentum < 1, e.g. 0.9; got {self.momentum!r}")
        if not 0.0 <= self.clip < float("inf"):
            raise ValueError(f"clip must be a finite number >= 0 (0: no clipping), e.g. 1.0; got {self.clip!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0 (0: no warm-up); got {self.warmup_steps!r}")
        if not 0.0 < self.warmup_ratio <= 1.0:
            raise ValueError(f"warmup_ratio must be 0 < warmup_ratio <= 1, e.g. 0.25; got {self.warmup_ratio!r}")


@register("dgc")
class DGC(Compressor):
    collective = "allgather"
    schemes = ("allgather",)
    biased = True
    fixed_size = False  # with warm-up; an instance without warm-up has fixed_size = True
    description = "Deep Gradient Compression: top-k of momentum-corrected accumulation, masking, clipping, warm-up"
    Config = DGCConfig

    def __init__(self, config: DGCConfig | None = None) -> None:
        super().__init__(config)
        self.fixed_size = self.config.warmup_steps == 0
        self.state: dict[str, tuple[Tensor, Tensor, int]] = {}  # key -> (u, v, steps); see begin_step

    def density(self, step: int) -> float:
        c = self.config
        warm = step < c.warmup_steps and c.warmup_ratio > c.ratio
        return c.warmup_ratio * (c.ratio / c.warmup_ratio) ** (step / c.warmup_steps) if warm else c.ratio

    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, _Ctx]:
        g = torch.nan_to_num(tensor.detach().reshape(-1).float(), nan=0.0, posinf=0.0, neginf=0.0)
        if self.config.clip > 0 and g.numel():
            norm = torch.linalg.vector_norm(g, dtype=torch.float64)  # fp64: no overflow of the squares
            g.mul_((self.config.clip / norm).clamp_(max=1.0).float())
        st = self.state.get(key)
        u, v, step = st if st and st[0].shape == g.shape else (torch.zeros_like(g), torch.zeros_like(g), 0)
        u = torch.add(g, u.to(g.device), alpha=self.config.momentum)  # new tensors (see begin_step)
        v = torch.add(v.to(g.device), u)
        idx = topk_indices(v, k_of(self.density(step), g.numel()))
        values = cast_saturating(v[idx], tensor.dtype)
        u[idx] = 0.0
        v[idx] = (v[idx] - values.float()).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        self.state[key] = (u, v, step + 1)
        return (values, idx), _Ctx(tensor.shape, tensor.dtype)

    # Top-k's payload: its decoding, and its bytes for ``ratio`` (the steady state).
    decompress = TopK.decompress
    payload_bytes = TopK.payload_bytes

    def begin_step(self) -> None:  # entries are replaced, never written once stored: references suffice
        self._undo = dict(self.state)

    def end_step(self, keep: bool) -> None:
        undo = self.__dict__.pop("_undo", None)
        self.state = undo if not keep and undo is not None else self.state

    def residuals(self, key: str) -> list[Tensor] | None:
        return [self.state[key][1]] if key in self.state else None

    def set_residuals(self, key: str, tensors: Sequence[Tensor]) -> None:
        v = flatten(tensors).to(torch.float32, copy=True) if tensors else torch.zeros(0)
        self.state[key] = (torch.zeros_like(v), v, 0)

    def forget(self, key: str) -> None:
        self.state = {k: s for k, s in self.state.items() if not key_under(k, key)}

    def state_dict(self) -> dict[str, Any]:
        return {"u_v_steps": {k: [u.clone(), v.clone(), n] for k, (u, v, n) in self.state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = {str(k): (u.clone(), v.clone(), int(n)) for k, (u, v, n) in state.get("u_v_steps", {}).items()}
