"""Which synchroniser a ``gradzip train`` configuration gets, and how the loop steps its optimizer.

Every mode implements :class:`gradzip.engine.synchronizer.Synchronizer` and is registered by name
in :mod:`gradzip.engine.modes` (``step``, ``diloco``, ``localsgd``, ``auto``, ``fsdp``, ``hsdp``,
``sparseloco+hsdp``, and any mode a module registers with :func:`gradzip.engine.modes.register_sync`). Building one is a
lookup: :func:`make_synchronizer` turns the configuration into the typed
:class:`~gradzip.engine.modes.SyncSettings` every mode takes, and the settings name the mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradzip.engine.config import EngineConfig
from gradzip.engine.modes import SyncSettings, build_synchronizer
from gradzip.engine.synchronizer import Synchronizer
from gradzip.training.config import TrainConfig
from gradzip.training.precision import Precision
from gradzip.training.sharding import shard_model


def sync_settings(cfg: TrainConfig, replicas: Any = None) -> SyncSettings:
    """The synchroniser's part of ``cfg``; every rank compares ``cfg.agreement()`` with the others'
    at start-up. ``replicas``: HSDP's replica group (from :func:`prepare_model`)."""
    engine = EngineConfig(bucket_cap_mb=cfg.bucket_cap_mb, min_compress_numel=cfg.min_compress_numel,
                          agree=cfg.agreement(), hierarchical=cfg.hierarchical, intra_dtype=cfg.intra_dtype)
    return SyncSettings(spec=cfg.spec, sync=cfg.sync_spec, engine=engine, sharding=cfg.sharding, replicas=replicas,
                        ef_dtype=cfg.ef_dtype, timeout=cfg.timeout, log_dir=str(cfg.out) if cfg.out else None)


def prepare_model(cfg: TrainConfig, model: torch.nn.Module, world: int, device: torch.device) -> Any:
    """What a mode needs done to the model before its optimizer exists: ``--fsdp``/``--hsdp`` shard
    it in place (:mod:`gradzip.training.sharding`; returns HSDP's replica group). Other modes: None."""
    if cfg.sharding == "none":
        return None
    return shard_model(model, cfg.sharding, world, cfg.ranks_per_node, device)


def make_synchronizer(cfg: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      runtime: Any, replicas: Any = None) -> Synchronizer:
    """The synchroniser of ``cfg`` over ``runtime.target`` (a communicator or a sim world)."""
    return build_synchronizer(model, optimizer, runtime.target, sync_settings(cfg, replicas))


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
