"""Sync modes, registered by name as compressors are: building a synchroniser is one lookup.

A mode is a name, the section of settings it reads, and a builder::

    register_sync("myouter", "every H steps, my outer update (every=H)", build_myouter,
                  keys=("every", "outer_lr", "scale"))

- ``keys``: the mode's ``--sync NAME:key=value`` parameters (its config section), registered with
  :mod:`gradzip.plan.sync` so that ``gradzip train --sync`` and ``gradzip simulate --sync`` accept
  the spelling. ``None``: not a ``--sync`` spelling (``auto``, ``fsdp`` and ``hsdp`` are chosen by
  ``--compressor auto`` and ``--fsdp``/``--hsdp``; ``MODE+SHARDING``, e.g. ``sparseloco+hsdp``, by
  ``--sync MODE`` with ``--hsdp``: an outer mode on a sharded model).
- ``defaults``: text values of some of ``keys`` for when they are not given (``every`` among them:
  ``--sync NAME`` alone then parses).
- ``codec``: for a mode that sends every parameter through a codec of its own in place of
  ``--compressor``, the compressor spec of its parsed ``--sync`` (``gradzip simulate`` prices the
  mode's exchange with it: :func:`gradzip.plan.sync.mode_codec`).
- ``build(model, optimizer, target, settings)``: the :class:`~gradzip.engine.synchronizer.Synchronizer`
  over ``target`` (a communicator, or a :class:`~gradzip.comm.sim.SimWorld`), from the typed
  :class:`SyncSettings` every mode takes.

The built-in modes are registered at the end of this module; a new mode is one file in
``gradzip/engine/`` that defines its class and calls :func:`register_sync` once (``gradzip train``
imports every module of this package through :func:`load_modes`).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gradzip.engine.config import EngineConfig
from gradzip.engine.synchronizer import Synchronizer
from gradzip.errors import GradzipError
from gradzip.plan.auto import is_auto
from gradzip.plan.sync import SyncSpec, register_spelling, unregister_spelling

Builder = Callable[[torch.nn.Module, torch.optim.Optimizer, Any, "SyncSettings"], Synchronizer]


@dataclass(frozen=True)
class SyncSettings:
    """The typed configuration every synchroniser takes (``gradzip train``: ``TrainConfig.sync_settings``).

    spec: the compressor spec. sync: ``--sync`` parsed (the outer modes' section).
    engine: buckets, agreement and the hierarchical exchange (:class:`EngineConfig`).
    sharding: ``none``, ``fsdp`` or ``hsdp``; replicas: HSDP's replica group (a process group).
    ef_dtype: the sharded modes' error-memory dtype (``fp32``, ``bf16``). timeout: seconds per
    collective. log_dir: where a mode writes its own logs (``auto``: ``policy.jsonl``).
    """

    spec: str = "none"
    sync: SyncSpec = field(default_factory=SyncSpec)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sharding: str = "none"
    replicas: Any = None
    ef_dtype: str = "fp32"
    timeout: float | None = None
    log_dir: str | None = None

    @property
    def mode(self) -> str:
        """The registered mode these settings select: the sharding (``fsdp``, ``hsdp``) first, as it
        decides where gradients live (with an outer ``--sync`` mode, ``MODE+SHARDING``, e.g.
        ``sparseloco+hsdp``); then ``auto`` for ``--compressor auto``; then ``--sync``'s mode."""
        if self.sharding != "none":
            return f"{self.sync.mode}+{self.sharding}" if self.sync.outer else self.sharding
        if is_auto(self.spec):
            return "auto"
        return self.sync.mode


@dataclass(frozen=True)
class SyncMode:
    """One registered mode (module docstring)."""

    name: str
    help: str
    build: Builder
    keys: tuple[str, ...] | None = None
    defaults: tuple[tuple[str, str], ...] = ()
    machine_check: Callable[[SyncSpec], None] | None = None


SYNC_MODES: dict[str, SyncMode] = {}


def register_sync(name: str, help: str, build: Builder, keys: tuple[str, ...] | None = None,
                  defaults: dict[str, str] | None = None, codec: Callable[[SyncSpec], str] | None = None,
                  machine_check: Callable[[SyncSpec], None] | None = None) -> SyncMode:
    """Register mode ``name`` (module docstring); a second registration of a name is an error.
    ``machine_check(sync)``: what this machine must offer the mode (an optional package, a server
    answering), raising a one-line :class:`GradzipError`; run by :func:`check_machine`."""
    if name in SYNC_MODES:
        raise ValueError(f"sync mode {name!r} is registered twice")
    mode = SyncMode(name, help, build, None if keys is None else tuple(keys), tuple((defaults or {}).items()),
                    machine_check)
    if mode.keys is not None:
        register_spelling(name, help, mode.keys, dict(mode.defaults), codec)
    SYNC_MODES[name] = mode
    return mode


def unregister_sync(name: str) -> None:
    """Remove mode ``name`` (and its ``--sync`` spelling); for tests and plugins that unload."""
    mode = SYNC_MODES.pop(name, None)
    if mode is not None and mode.keys is not None:
        unregister_spelling(name)


def load_modes() -> dict[str, SyncMode]:
    """Every registered mode, after importing each module of :mod:`gradzip.engine` (a mode in a
    new file registers itself at import)."""
    for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if not mod.name.startswith("_"):
            importlib.import_module(f"gradzip.engine.{mod.name}")
    return SYNC_MODES


def check_machine(sync: SyncSpec) -> None:
    """The registered mode's :attr:`SyncMode.machine_check` of ``sync``, before a run starts its
    world (a mode without one needs nothing of the machine)."""
    mode = SYNC_MODES.get(sync.mode) or load_modes().get(sync.mode)
    if mode is not None and mode.machine_check is not None:
        mode.machine_check(sync)


def build_synchronizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, target: Any,
                       settings: SyncSettings) -> Synchronizer:
    """The synchroniser of ``settings.mode`` over ``target``: one lookup, then its builder."""
    mode = SYNC_MODES.get(settings.mode) or load_modes().get(settings.mode)
    if mode is None:
        raise GradzipError(f"no sync mode {settings.mode!r} is registered; registered: {', '.join(SYNC_MODES)}")
    return mode.build(model, optimizer, target, settings)


def sharded_outer(sync: SyncSpec, sharding: str) -> bool:
    """Whether outer mode ``sync`` runs on a model sharded with ``sharding`` (a registered
    ``MODE+SHARDING``, e.g. ``sparseloco+hsdp``)."""
    name = f"{sync.mode}+{sharding}"
    return name in SYNC_MODES or name in load_modes()


# ---------------------------------------------------------------------- the built-in modes
def _engine_kwargs(s: SyncSettings) -> dict[str, Any]:
    e = s.engine
    return {"bucket_cap_mb": e.bucket_cap_mb, "min_compress_numel": e.min_compress_numel, "agree": e.agree,
            "hierarchical": e.hierarchical, "intra_dtype": e.intra_dtype}


def _build_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, target: Any,
                s: SyncSettings) -> Synchronizer:
    from gradzip.engine.engine import attach

    engine = attach(model, s.spec, target, **_engine_kwargs(s))
    engine.bind_optimizer(optimizer)
    return engine


def _build_outer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, target: Any,
                 s: SyncSettings) -> Synchronizer:
    """DiLoCo and LocalSGD: the inner optimizer steps on local gradients, syncs every H steps."""
    from gradzip.engine.diloco import DiLoCo

    sync = s.sync  # the outer optimizer: SGD, Nesterov when momentum > 0
    params = [p for p in model.parameters() if p.requires_grad]
    outer = torch.optim.SGD(params, lr=sync.outer_lr, momentum=sync.momentum, nesterov=sync.nesterov, foreach=True)
    return DiLoCo(model, optimizer, outer, target, sync.every, s.spec, sync.fragments,
                  sync.delay, sync.alpha, **_engine_kwargs(s), outer_overlap=sync.overlap, hook=False)


def _build_auto(model: torch.nn.Module, optimizer: torch.optim.Optimizer, target: Any,
                s: SyncSettings) -> Synchronizer:
    """A candidate per bucket, chosen and re-chosen from the measured link (``policy.jsonl``)."""
    from gradzip.engine.auto import AutoEngine

    e = s.engine
    config = EngineConfig(bucket_cap_mb=e.bucket_cap_mb, min_compress_numel=e.min_compress_numel, agree=e.agree,
                          hierarchical=e.hierarchical, intra_dtype=e.intra_dtype)
    auto = AutoEngine(model, s.spec, target, config,
                      log=None if s.log_dir is None else Path(s.log_dir) / "policy.jsonl")
    auto.bind_optimizer(optimizer)
    return auto


def _build_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, target: Any,
                   s: SyncSettings) -> Synchronizer:
    """FSDP2/HSDP: the model was sharded before its optimizer was made; compress its reductions."""
    from gradzip.engine.fsdp import fsdp_compress
    from gradzip.engine.fsdp_sync import FSDPSync

    ef_dtype = torch.bfloat16 if s.ef_dtype == "bf16" else None
    comp = fsdp_compress(model, s.spec, replicate=s.replicas, ef_dtype=ef_dtype, timeout=s.timeout,
                         agree=s.engine.agree)
    return FSDPSync(model, comp, getattr(target, "rank", 0))


register_sync("step", "exchange gradients every step (default)", _build_step, keys=())
register_sync("diloco", "H inner steps, then an outer Nesterov step on the averaged pseudo-gradient "
              "(every=H,outer_lr=0.7,momentum=0.9,fragments=1,delay=0,alpha=0)", _build_outer,
              keys=("every", "outer_lr", "momentum", "fragments", "delay", "alpha", "nesterov", "overlap"))
register_sync("localsgd", "average the parameters every H steps (every=H)", _build_outer,
              keys=("every", "fragments", "delay", "overlap"))
register_sync("auto", "--compressor auto: a candidate per bucket, planned from the measured link", _build_auto)
register_sync("fsdp", "--fsdp: FSDP2's reduce-scatter compressed", _build_sharded)
register_sync("hsdp", "--hsdp: HSDP's replica all-reduce compressed", _build_sharded)
