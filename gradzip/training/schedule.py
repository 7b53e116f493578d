"""The learning-rate schedule of ``gradzip train``: :class:`WarmupDecay`, linear warm-up from ~0
to the peak LR, then polynomial (linear by default) decay that reaches 0 after the last step. Its
``state_dict()`` holds numbers only (``torch.load(weights_only=True)``)."""

from __future__ import annotations

from typing import Any

import torch


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
