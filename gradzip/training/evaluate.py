"""Held-out loss of the model, without touching the run's randomness."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from gradzip.training.config import TrainConfig
from gradzip.training.precision import Precision


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def evaluate(model: nn.Module, data: Any, cfg: TrainConfig, precision: Precision,
             device: torch.device) -> dict[str, float]:
    """Mean held-out loss over ``cfg.eval_batches`` batches. Uses no randomness of the run (the
    RNG is forked), so evaluating does not change the training that follows."""
    was_training = model.training
    model.eval()
    sums = np.zeros(3)
    n = 0
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for batch in data.eval_batches(batch_size=cfg.batch_size, max_batches=cfg.eval_batches):
                with precision.autocast():
                    out = model(**to_device(batch, device))
                sums += [float(out.loss), float(out.mlm_loss), float(out.nsp_loss)]
                n += 1
    finally:
        model.train(was_training)
    if n == 0:
        return {}
    loss, mlm, nsp = (float(x) / n for x in sums)  # Python floats: they go into checkpoints
    return {"eval_loss": loss, "eval_mlm_loss": mlm, "eval_nsp_loss": nsp}
