"""The optimizers of ``gradzip train --optimizer``, built over BERT's two param groups.

- ``adamw``: :class:`torch.optim.AdamW` (β = 0.9, 0.999; ε = 1e-6 as in BERT).
- ``sgd``: :class:`torch.optim.SGD` with ``--momentum`` (heavy-ball) and L2 weight decay.
- ``lamb``: :class:`gradzip.optim.lamb.Lamb`.
- ``demo``: DeMo (:mod:`gradzip.optim.demo`), the sign of the decoded ``demo`` exchange.
- ``onebit-adam``, ``onebit-lamb``: 1-bit Adam and 1-bit LAMB, which compress the momentum
  (:mod:`gradzip.optim.onebit`).
- Each is one :func:`~gradzip.optim.registry.register_optimizer` call at the end of this module;
  a new optimizer registers the same way from its own module.
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
from gradzip.optim.registry import Factory, get_optimizer, register_optimizer


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


def _without_adapt(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for g in groups:
        g.pop("adapt")
    return groups


def _adamw(groups: list[dict[str, Any]], lr: float, weight_decay: float, freeze_step: int,
           momentum: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(_without_adapt(groups), lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                             weight_decay=weight_decay)


def _lamb(groups: list[dict[str, Any]], lr: float, weight_decay: float, freeze_step: int,
          momentum: float) -> torch.optim.Optimizer:
    return Lamb(groups, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=weight_decay)


def _sgd(groups: list[dict[str, Any]], lr: float, weight_decay: float, freeze_step: int,
         momentum: float) -> torch.optim.Optimizer:
    # weight decay as L2 in the gradient (torch's SGD), biases and LayerNorm excepted
    return torch.optim.SGD(_without_adapt(groups), lr=lr, momentum=momentum, weight_decay=weight_decay)


def _onebit(lamb: bool) -> Factory:
    def factory(groups: list[dict[str, Any]], lr: float, weight_decay: float, freeze_step: int,
                momentum: float) -> torch.optim.Optimizer:
        return OneBitAdam(groups, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=weight_decay,
                          freeze_step=freeze_step, lamb=lamb)
    return factory


def _demo(groups: list[dict[str, Any]], lr: float, weight_decay: float, freeze_step: int,
          momentum: float) -> torch.optim.Optimizer:
    # the compression settings are the engine's demo:... spec
    return DeMo(_without_adapt(groups), lr=lr, weight_decay=weight_decay)


register_optimizer("adamw", _adamw)
register_optimizer("lamb", _lamb, help="lamb (You et al. 2019)")
register_optimizer("sgd", _sgd, help="sgd (--momentum, --weight-decay)")
register_optimizer("onebit-adam", _onebit(lamb=False),
                   help="onebit-adam, onebit-lamb: warm up uncompressed for --freeze-step steps, then exchange the "
                   "momentum compressed (onebit:exchange=twophase unless --compressor)")
register_optimizer("onebit-lamb", _onebit(lamb=True), help="")  # described with onebit-adam
register_optimizer("demo", _demo, help="demo: DeMo (Peng et al. 2024), local momentum sent as its top DCT "
                   "coefficients, sign step (demo:topk=32,chunk=64,decay=0.999 unless --compressor demo:... or, "
                   "for Psyche's DisTrO wire, distro:...)")


def build_optimizer(name: str, model: nn.Module, lr: float, weight_decay: float,
                    freeze_step: int = 1, momentum: float = 0.0) -> torch.optim.Optimizer:
    """The optimizer registered as ``name`` (:mod:`gradzip.optim.registry`) over
    :func:`param_groups` (``freeze_step``: the 1-bit optimizers' warm-up; ``momentum``: sgd's).
    Unknown names: a ValueError listing the registered ones."""
    factory = get_optimizer(name).factory
    return factory(param_groups(model, weight_decay), lr, weight_decay, freeze_step, momentum)
