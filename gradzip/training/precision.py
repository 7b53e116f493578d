"""Mixed precision for the training step: autocast, loss scaling, clipping and the optimizer step."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn


class Precision:
    """fp32; bf16 autocast (CPU or CUDA); fp16 autocast with a GradScaler (CUDA only).

    Parameters and their gradients stay fp32; the compressors see the gradients as they are.
    """

    def __init__(self, precision: str, device: torch.device) -> None:
        self.device = device
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], clip: float) -> float:
        """Unscale (fp16), clip to ``clip`` (0: off), step. Returns the gradient norm before clipping."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.nn.utils.get_total_norm(grads)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        return float(norm)

    def skip(self) -> None:
        """A step skipped for a non-finite gradient: fp16 backs its loss scale off, as GradScaler
        does when it finds inf itself (the overflow is the likely cause)."""
        if self.scaler is not None:
            self.scaler.update(new_scale=self.scaler.get_scale() * self.scaler.get_backoff_factor())

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.scaler is not None and sd:
            self.scaler.load_state_dict(sd)
