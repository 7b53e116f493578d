"""Held-out loss and accuracy of the model, without touching the run's randomness."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from gradzip.models.bert import IGNORE_INDEX
from gradzip.training.config import TrainConfig
from gradzip.training.precision import Precision


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def evaluate(model: nn.Module, data: Any, cfg: TrainConfig, precision: Precision,
             device: torch.device) -> dict[str, float]:
    """Mean held-out loss over ``cfg.eval_batches`` batches, and the accuracies: masked-token
    accuracy (top-1 over every masked position of those batches) and next-sentence accuracy (over
    their sequences); on a generated language, ``eval_excess_loss``, the masked-LM loss above the
    Bayes-optimal loss of the same batches. Uses no randomness of the run (the RNG is forked), so evaluating does not
    change the training that follows."""
    was_training = model.training
    model.eval()
    sums = np.zeros(3)
    hits = np.zeros(4)  # masked tokens right, masked tokens, next-sentence labels right, sequences
    n = 0
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for batch in data.eval_batches(batch_size=cfg.batch_size, max_batches=cfg.eval_batches):
                with precision.autocast():
                    out = model(**to_device(batch, device))
                sums += [float(out.loss), float(out.mlm_loss), float(out.nsp_loss or 0.0)]
                hits += _hits(out, to_device(batch, device))
                n += 1
    finally:
        model.train(was_training)
    if n == 0:
        return {}
    loss, mlm, nsp = (float(x) / n for x in sums)  # Python floats: they go into checkpoints
    res = {"eval_loss": loss, "eval_mlm_loss": mlm}
    if hits[3]:
        res["eval_nsp_loss"] = nsp
    optimum = data.optimal_mlm_loss(batch_size=cfg.batch_size, max_batches=cfg.eval_batches)
    if optimum is not None:  # a generated language: the loss above the Bayes-optimal one
        res["eval_excess_loss"] = mlm - optimum
    if hits[1]:
        res["eval_mlm_acc"] = float(hits[0] / hits[1])
    if hits[3]:
        res["eval_nsp_acc"] = float(hits[2] / hits[3])
    return res


def _hits(out: Any, batch: dict[str, torch.Tensor]) -> list[float]:
    """Right and total predictions of one batch: masked tokens (the model returns logits for the
    masked positions only, in row-major order), then next-sentence labels."""
    targets = batch["labels"][batch["labels"] != IGNORE_INDEX]
    mlm = out.prediction_logits.argmax(-1).reshape(-1)
    if "next_sentence_label" not in batch:  # masked LM alone (the generated tier)
        return [float((mlm == targets).sum()), float(targets.numel()), 0.0, 0.0]
    nsp_labels = batch["next_sentence_label"].reshape(-1)
    nsp = out.seq_relationship_logits.argmax(-1).reshape(-1)
    return [float((mlm == targets).sum()), float(targets.numel()), float((nsp == nsp_labels).sum()),
            float(nsp_labels.numel())]
