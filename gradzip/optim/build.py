"""The optimizers of ``gradzip train --optimizer``, built over BERT's two param groups.

- ``adamw``: :class:`torch.optim.AdamW` (β = 0.9, 0.999; ε = 1e-6 as in BERT).
- ``sgd``: :class:`torch.optim.SGD` with ``--momentum`` (heavy-ball) and L2 weight decay.
- ``lamb``: :class:`gradzip.optim.lamb.Lamb`.
- ``demo``: DeMo (:mod:`gradzip.optim.demo`), the sign of the decoded ``demo`` exchange.
- ``onebit-adam``, ``onebit-lamb``: 1-bit Adam and 1-bit LAMB, which compress the momentum
  (:mod:`gradzip.optim.onebit`).
- Weight decay is decoupled and skips biases and LayerNorm parameters (every tensor with fewer
  than two dimensions), as in BERT's reference code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradzip.optim.demo import DeMo
from gradzip.optim.lamb import ADAM_BETAS, ADAM_EPS, Lamb
from gradzip.optim.onebit import OneBitAdam


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
        for g in groups:
            g.pop("adapt")
        return DeMo(groups, lr=lr, weight_decay=weight_decay)
    if name == "lamb":
        return Lamb(groups, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose adamw, lamb, sgd, onebit-adam, onebit-lamb or demo")
