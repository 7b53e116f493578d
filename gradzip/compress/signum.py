"""``signum``: Signum, signSGD with momentum and majority vote (Bernstein et al., ICML 2018; ICLR 2019).

Algorithm, per key (the bucket, read flat) and step:

1. Worker momentum, fp32, per key: m = momentum * m + (1 - momentum) * g, with the non-finite
   entries of g taken as 0 (so NaN/inf never enter m; the engine skips such steps and restores m).
2. Payload, as ``signsgd``: the sign bits of m packed 8 per byte (bit 1 = negative; m = +0 counts as
   positive) plus one fp32 scale = mean(|m|) of this rank: ceil(n / 8) + 4 bytes.
3. Allgather; each rank decodes every payload to scale_r * sign(m_r), and the majority vote of
   ``signsgd`` combines them: sign(sum over ranks of sign_r) * mean over ranks of scale_r. A tie
   gives 0; a rank whose m is all zero abstains.

Scale: the paper sends signs only and lets the learning rate set the step (lr ~1e-4 with Signum).
Here the vote is scaled by the ranks' mean |m|, as ``signsgd`` scales by mean |g|: the update keeps
the gradient's order of magnitude, so the learning rates of momentum SGD work, and fp16/bf16
gradients hold it (mean |m| <= max |g|). Since m starts at 0, the first ~1 / (1 - momentum) steps
are smaller (the scale grows like 1 - momentum^t): a built-in warm-up; the signs are unaffected.

Biased, no error feedback by default, as in the paper (``signum:ef=true`` adds it). Momentum lives
here: use an optimizer without momentum (plain SGD); ``momentum=0`` is ``signsgd``. Tuning: 0.9 as
in the paper; the vote makes it robust to a minority of bad ranks; expect a gap to SGD on
heterogeneous data, which ``onebit`` (error feedback) closes. m is not an error memory: a DDP
bucket rebuild (after its first step) restarts it. Not ``twophase``: its server would apply a
second momentum to the shard's vote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradzip.compress.base import Payload, key_under
from gradzip.compress.bitpack import mean_abs, pack_signs
from gradzip.compress.registry import register
from gradzip.compress.signsgd import SignSGD


@dataclass
class SignumConfig:
    momentum: float = 0.9  # 0 <= momentum < 1; 0 is signSGD

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be 0 <= momentum < 1 (0: signSGD), e.g. 0.9; got {self.momentum!r}")


@register("signum")
class Signum(SignSGD):
    """Decoding and the majority vote are ``signsgd``'s; the payload is that of m instead of g."""

    schemes = ("allgather",)
    default_ef = False
    description = "Signum: worker momentum m, packed sign(m) + fp32 mean|m|, majority vote * mean scale"
    Config = SignumConfig

    def __init__(self, config: SignumConfig | None = None) -> None:
        super().__init__(config)
        self.state: dict[str, Tensor] = {}  # key -> m (fp32); replaced each step, never written in place

    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, tuple[torch.Size, torch.dtype]]:
        beta = self.config.momentum
        m = torch.nan_to_num(tensor.detach().reshape(-1).float(), nan=0.0, posinf=0.0, neginf=0.0).mul_(1 - beta)
        old = self.state.get(key)
        if old is not None and old.shape == m.shape:
            m.add_(old.to(m.device), alpha=beta)
        self.state[key] = m
        return (pack_signs(m), mean_abs(m).reshape(1)), (tensor.shape, tensor.dtype)

    def begin_step(self) -> None:  # entries are replaced, never written once stored: references suffice
        self._undo = dict(self.state)

    def end_step(self, keep: bool) -> None:
        undo = self.__dict__.pop("_undo", None)
        self.state = undo if not keep and undo is not None else self.state

    def forget(self, key: str) -> None:
        self.state = {k: m for k, m in self.state.items() if not key_under(k, key)}

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": {k: m.clone() for k, m in self.state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = {str(k): m.clone() for k, m in state.get("momentum", {}).items()}
