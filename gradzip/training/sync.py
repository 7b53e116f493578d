"""Which synchroniser a ``gradzip train`` configuration gets, and how the loop steps its optimizer.

Every mode implements :class:`gradzip.engine.synchronizer.Synchronizer`, so the loop has one path:

- ``--sync step`` (default): :class:`gradzip.engine.Engine`, the per-step compressed exchange,
  following the optimizer's exchange plan when it has one (1-bit Adam/LAMB, DeMo);
- ``--sync diloco|localsgd``: :class:`gradzip.engine.diloco.DiLoCo`, inner steps on local
  gradients and a compressed outer sync every H steps (fragments: Streaming DiLoCo);
- ``--compressor auto``: :class:`gradzip.engine.auto.AutoEngine`, a candidate compressor per
  bucket, planned from the measured link and re-planned when it drifts (``policy.jsonl``);
- ``--fsdp``/``--hsdp``: :class:`gradzip.engine.fsdp_sync.FSDPSync`, FSDP2's reductions of the
  sharded model (:mod:`gradzip.training.sharding`) compressed by :func:`gradzip.fsdp_compress`.

A new mode adds one branch here and one class in :mod:`gradzip.engine`; the loop stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradzip.engine import attach
from gradzip.engine.config import EngineConfig
from gradzip.engine.diloco import DiLoCo, outer_sgd
from gradzip.engine.synchronizer import Synchronizer
from gradzip.plan.auto import is_auto
from gradzip.training.config import TrainConfig
from gradzip.training.precision import Precision


def make_synchronizer(cfg: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      runtime: Any, replicas: Any = None) -> Synchronizer:
    """The synchroniser of ``cfg.sync`` over ``runtime.target`` (a communicator or a sim world).
    Every rank compares its settings (``cfg.agreement()``) with the others' at start-up. A sharded
    model (``cfg.sharding``) gets FSDPSync; ``replicas``: HSDP's replica group."""
    if cfg.sharding != "none":
        from gradzip.engine.fsdp import fsdp_compress
        from gradzip.engine.fsdp_sync import FSDPSync

        ef_dtype = torch.bfloat16 if cfg.ef_dtype == "bf16" else None
        return FSDPSync(model, fsdp_compress(model, cfg.spec, replicate=replicas, ef_dtype=ef_dtype,
                                             timeout=cfg.timeout, agree=cfg.agreement()), runtime.rank)
    if is_auto(cfg.spec):  # a candidate per bucket, chosen and re-chosen from the measured link
        from gradzip.engine.auto import AutoEngine

        config = EngineConfig(bucket_cap_mb=cfg.bucket_cap_mb, min_compress_numel=cfg.min_compress_numel,
                              agree=cfg.agreement(), hierarchical=cfg.hierarchical, intra_dtype=cfg.intra_dtype)
        auto = AutoEngine(model, cfg.spec, runtime.target, config, log=Path(cfg.out) / "policy.jsonl")
        auto.bind_optimizer(optimizer)
        return auto
    sync = cfg.sync_spec
    if sync.outer:  # the inner optimizer steps on local gradients; DiLoCo syncs every H steps
        return DiLoCo(model, optimizer, outer_sgd(model, sync), runtime.target, sync.every, cfg.spec,
                      sync.fragments, sync.delay, sync.alpha, bucket_cap_mb=cfg.bucket_cap_mb,
                      min_compress_numel=cfg.min_compress_numel, hierarchical=cfg.hierarchical,
                      intra_dtype=cfg.intra_dtype, agree=cfg.agreement(), hook=False)
    engine = attach(model, cfg.spec, runtime.target, bucket_cap_mb=cfg.bucket_cap_mb,
                    min_compress_numel=cfg.min_compress_numel, agree=cfg.agreement(),
                    hierarchical=cfg.hierarchical, intra_dtype=cfg.intra_dtype)
    engine.bind_optimizer(optimizer)
    return engine


@dataclass
class Stepper:
    """The loop's :class:`gradzip.engine.synchronizer.OptimizerStep`: mixed precision's unscale and
    loss-scale updates, gradient clipping at ``clip`` (0: off), then the optimizer's step."""

    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    precision: Precision
    clip: float

    def step(self, clip: bool = True) -> float:
        return self.precision.step(self.optimizer, self.params, self.clip if clip else 0.0)

    def skip(self) -> None:
        self.precision.skip()
