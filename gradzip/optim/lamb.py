"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", Algorithm 2), with the Adam pieces it shares with 1-bit Adam/LAMB (:mod:`gradzip.optim.onebit`).

Weight decay is decoupled; which tensors get it (and LAMB's layer adaptation) is the param groups'
choice (:func:`gradzip.optim.build.param_groups`). ``state_dict()`` holds tensors and numbers only,
so checkpoints load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-6


def adam_state(state: dict[str, Any], p: Tensor) -> tuple[float, Tensor, Tensor]:
    """Adam's per-tensor state in ``state`` (created on first use: fp32 moments, a step counter),
    with the counter advanced: ``(t, exp_avg, exp_avg_sq)`` for this step."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
    state["step"] += 1
    return float(state["step"]), state["exp_avg"], state["exp_avg_sq"]


class Lamb(torch.optim.Optimizer):
    """LAMB: Adam's update rescaled per parameter tensor by the trust ratio ``‖w‖ / ‖u‖``.

    For each parameter tensor ``w`` with gradient ``g``, at step ``t`` (You et al. 2019, Alg. 2)::

        m = β1·m + (1−β1)·g                      v = β2·v + (1−β2)·g²
        m̂ = m / (1−β1^t)                         v̂ = v / (1−β2^t)
        u = m̂ / (√v̂ + ε) + λ·w                   (decoupled weight decay λ)
        r = ‖w‖ / ‖u‖   (r = 1 if ‖w‖ = 0 or ‖u‖ = 0, or the group has adapt=False)
        w = w − lr · r · u

    Conventions: ``r = 1`` when either norm is zero (fresh zero-initialised tensors still move,
    and an all-zero update is a no-op); groups with ``adapt=False`` (biases, LayerNorm: see
    :func:`param_groups`) skip the trust ratio, as in the reference implementation's
    ``exclude_from_layer_adaptation``. No clamp of ``‖w‖`` (the paper's φ is the identity).

    Tuning: LAMB is meant for large batches; the paper scales the LR with the square root of the
    batch size and always warms up. On small models and batches start from AdamW's LR.
    ``self.last_trust_ratios`` holds the ratios of the last step (for logging and tests).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = ADAM_BETAS,
                 eps: float = ADAM_EPS, weight_decay: float = 0.0, adapt: bool = True) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0:
            raise ValueError(f"Lamb: need lr > 0, eps > 0, weight_decay >= 0 (got {lr}, {eps}, {weight_decay})")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lamb: betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adapt=adapt))
        self.last_trust_ratios: list[float] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ratios: list[Tensor] = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float() if p.grad.dtype != torch.float32 else p.grad
                t, m, v = adam_state(self.state[p], p)
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                # u = m̂ / (√v̂ + ε) + λ w, with the bias corrections folded into two scalars
                denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
                update = (m / (1 - beta1**t)).div_(denom)
                if group["weight_decay"]:
                    update.add_(p.float(), alpha=group["weight_decay"])
                ratio = trust_ratio(p, update) if group["adapt"] else torch.ones((), device=p.device)
                ratios.append(ratio)
                p.add_((update * ratio).to(p.dtype), alpha=-group["lr"])
        self.last_trust_ratios = [float(r) for r in ratios] if ratios else []
        return loss


def trust_ratio(w: Tensor, update: Tensor) -> Tensor:
    """``‖w‖ / ‖update‖`` (L2 over the whole tensor), or 1 when either norm is zero."""
    w_norm = torch.linalg.vector_norm(w.float())
    u_norm = torch.linalg.vector_norm(update.float())
    one = torch.ones((), dtype=torch.float32, device=w.device)
    return torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm.clamp_min(1e-38), one)
