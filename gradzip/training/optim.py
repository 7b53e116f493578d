"""Optimizers and the learning-rate schedule of ``gradzip train``.

- ``adamw``: :class:`torch.optim.AdamW` (β = 0.9, 0.999; ε = 1e-6 as in BERT).
- ``sgd``: :class:`torch.optim.SGD` with ``--momentum`` (heavy-ball) and L2 weight decay.
- ``lamb``: :class:`Lamb`, our implementation of You et al. 2019, "Large Batch Optimization for
  Deep Learning: Training BERT in 76 minutes" (Algorithm 2).
- ``demo``: DeMo (:mod:`gradzip.training.demo_optim`), the sign of the decoded ``demo`` exchange.
- ``onebit-adam``, ``onebit-lamb``: 1-bit Adam and 1-bit LAMB, which compress the momentum
  (:mod:`gradzip.training.onebit_optim`).
- Weight decay is decoupled and skips biases and LayerNorm parameters (every tensor with fewer
  than two dimensions), as in BERT's reference code.
- :class:`WarmupDecay`: linear warm-up from ~0 to the peak LR, then polynomial (linear by
  default) decay that reaches 0 after the last step.

Everything has ``state_dict()``/``load_state_dict()`` made of tensors and numbers only, so
checkpoints load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-6


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: matrices and embeddings get ``weight_decay`` and LAMB's layer adaptation;
    biases and LayerNorm weights (``ndim < 2``) get neither."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "adapt": True},
              {"params": no_decay, "weight_decay": 0.0, "adapt": False}]
    return [g for g in groups if g["params"]]


def build_optimizer(name: str, model: nn.Module, lr: float, weight_decay: float,
                    freeze_step: int = 1, momentum: float = 0.0) -> torch.optim.Optimizer:
    """``adamw``, ``lamb``, ``onebit-adam`` or ``onebit-lamb`` over :func:`param_groups`
    (``freeze_step``: the 1-bit optimizers' warm-up)."""
    groups = param_groups(model, weight_decay)
    if name in ("onebit-adam", "onebit-lamb"):
        from gradzip.training.onebit_optim import OneBitAdam  # it imports this module

        return OneBitAdam(groups, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=weight_decay,
                          freeze_step=freeze_step, lamb=name == "onebit-lamb")
    if name == "adamw":
        for g in groups:
            g.pop("adapt")
        return torch.optim.AdamW(groups, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=weight_decay)
    if name == "sgd":  # weight decay as L2 in the gradient (torch's SGD), biases and LayerNorm excepted
        for g in groups:
            g.pop("adapt")
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "demo":  # the compression settings are the engine's demo:... spec
        from gradzip.training.demo_optim import DeMo

        for g in groups:
            g.pop("adapt")
        return DeMo(groups, lr=lr, weight_decay=weight_decay)
    if name == "lamb":
        return Lamb(groups, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose adamw, lamb, sgd, onebit-adam, onebit-lamb or demo")


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


class WarmupDecay:
    """Linear warm-up, then polynomial decay to 0: the LR of the optimizer step with 0-based
    index ``k`` (``k = 0`` is the first step) is::

        k <  warmup:  peak · (k + 1) / warmup
        k >= warmup:  peak · ((total − k) / (total − warmup)) ** power

    so the first step is not wasted at LR 0 and the LR reaches 0 right after the last step.
    ``power = 1`` is linear (BERT); ``step()`` is called once after each optimizer step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, peak_lr: float, warmup: int, total: int,
                 power: float = 1.0) -> None:
        if total < 1 or not 0 <= warmup <= total:
            raise ValueError(f"need 0 <= warmup <= total and total >= 1, got warmup={warmup}, total={total}")
        self.optimizer, self.peak_lr, self.warmup, self.total, self.power = optimizer, peak_lr, warmup, total, power
        self.last_step = 0  # optimizer steps taken so far
        self._apply()

    def lr_at(self, k: int) -> float:
        """The LR of the step with 0-based index ``k``."""
        if k < self.warmup:
            return self.peak_lr * (k + 1) / self.warmup
        if k >= self.total:
            return 0.0
        return self.peak_lr * ((self.total - k) / (self.total - self.warmup)) ** self.power

    @property
    def lr(self) -> float:
        """The LR the next ``optimizer.step()`` uses."""
        return self.lr_at(self.last_step)

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def _apply(self) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "peak_lr": self.peak_lr, "warmup": self.warmup,
                "total": self.total, "power": self.power}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the position. Peak/warm-up/total stay as constructed, so a resumed run may
        extend ``--steps`` (the decay then stretches to the new end)."""
        self.last_step = int(state["last_step"])
        self._apply()
