"""The parts of torch's FSDP2 that gradzip reaches outside its public API, all in this module.

gradzip installs its communication with ``FSDPModule``'s public setters only
(``set_custom_reduce_scatter``, ``set_all_reduce_hook``, ``set_custom_all_gather``). What remains
private, and is read here and nowhere else:

- the base classes of those setters' arguments, ``ReduceScatter`` and ``AllGather``, which torch
  defines in ``torch.distributed.fsdp._fully_shard._fsdp_api`` without exporting them;
- each module's parameter groups (``FSDPModule._get_fsdp_state()._fsdp_param_groups``), to find
  the groups gradzip serves, refuse a module of several groups, and read a group's padded shard
  shapes, its gradient divide factor, its reduce-scatter process group and whether it is native HSDP;
- the communication a group has now (``_reduce_scatter_comm``, ``_all_reduce_hook``,
  ``_all_gather_comm``), which ``remove()`` hands back to the setters to restore FSDP's own, and
  which the byte counters of :mod:`gradzip.engine.fsdp_sync` wrap.

Nothing here writes a torch attribute. :func:`require_api` is the one check that the torch in use
has all of it, with one error naming the torch version and what it lacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradzip.errors import GradzipError

try:  # FSDP2's public module class; the setters' interfaces are defined, not exported, here
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - torch without FSDP2's custom collectives
    FSDPModule = None  # type: ignore[assignment,misc]
    AllGather = ReduceScatter = object  # type: ignore[assignment,misc]

SETTERS = ("set_custom_reduce_scatter", "set_all_reduce_hook", "set_custom_all_gather")
# What a parameter group must have for the reads below (checked once, by require_api's caller).
_GROUP_READS = ("fsdp_params", "mesh_info", "gradient_divide_factor", "_is_hsdp",
                "_reduce_scatter_comm", "_all_reduce_hook", "_all_gather_comm")


def missing_api() -> list[str]:
    """What this torch lacks of the FSDP2 interface gradzip uses (empty: nothing)."""
    if FSDPModule is None:
        return ["torch.distributed.fsdp.FSDPModule (FSDP2's fully_shard)"]
    missing = [f"FSDPModule.{name}" for name in (*SETTERS, "_get_fsdp_state") if not hasattr(FSDPModule, name)]
    if ReduceScatter is object or AllGather is object:
        missing.append("torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter/AllGather")
    return missing


def require_api(missing: list[str] | None = None) -> None:
    """Raise one :class:`GradzipError` naming the torch version and what it lacks, unless this torch
    has FSDP2's custom-communication setters and the interfaces gradzip reads."""
    missing = missing_api() if missing is None else missing
    if missing:
        raise GradzipError(f"fsdp_compress needs torch's FSDP2 with FSDPModule.set_custom_reduce_scatter, "
                           f"set_all_reduce_hook and set_custom_all_gather (torch 2.13 has them); torch "
                           f"{torch.__version__} lacks {', '.join(missing)}: install a newer torch")


def is_fsdp_module(m: nn.Module) -> bool:
    return FSDPModule is not None and isinstance(m, FSDPModule)


def param_groups(module: nn.Module) -> list[Any]:
    """The FSDP parameter groups of one FSDP module (several with a per-parameter mesh)."""
    return list(module._get_fsdp_state()._fsdp_param_groups)  # type: ignore[operator]


def check_one_group(name: str, module: nn.Module) -> None:
    """One parameter group per FSDP module: FSDP2's setters (and, in later torch, its hooks) refuse
    a module of several, whose custom collective would be ambiguous across their meshes."""
    n = len(param_groups(module))
    if n > 1:
        raise GradzipError(f"fsdp_compress: module {name or 'root'!r} has {n} FSDP parameter groups (a "
                           "per-parameter mesh from fully_shard's shard_placement_fn), and FSDP2's custom "
                           "collectives serve a module of one group only; shard that module on one mesh")


@dataclass
class Installed:
    """The communication a parameter group has now: what a setter restores it to."""

    reduce_scatter: Any
    all_reduce_hook: Any
    all_gather: Any


@dataclass
class FSDPUnit:
    """An FSDP module whose one parameter group gradzip serves. ``key``: its name in the model
    (``"root"`` for the model), which keys its compressor state; ``module``: the ``FSDPModule``,
    on which gradzip calls the public setters. The properties read the parameter group."""

    key: str
    module: nn.Module
    group: Any  # torch's FSDPParamGroup (private): read here only

    @property
    def shard_shapes(self) -> list[torch.Size]:
        """Each parameter's padded shard shape, in the order of the reduce-scatter input."""
        return [fp.padded_sharded_param_size for fp in self.group.fsdp_params]

    @property
    def divide_factor(self) -> float | None:
        """The gradient divide factor set by ``set_gradient_divide_factor`` (None: FSDP's default)."""
        return self.group.gradient_divide_factor

    @property
    def shard_group(self) -> Any:
        """The process group of this module's reduce-scatter."""
        info = self.group.mesh_info
        return getattr(info, "reduce_scatter_process_group", None) or info.shard_process_group

    @property
    def native_hsdp(self) -> bool:
        """Sharded with FSDP2's own HSDP (a 2-D mesh)."""
        return bool(self.group._is_hsdp)

    def installed(self) -> Installed:
        """The group's communication now (FSDP's own, or what a setter installed)."""
        g = self.group
        return Installed(g._reduce_scatter_comm, g._all_reduce_hook, g._all_gather_comm)


def fsdp_units(model: nn.Module) -> list[FSDPUnit]:
    """Every FSDP module of ``model`` that manages parameters, as :class:`FSDPUnit` (one per group:
    ``fully_shard([a, b])`` gives several modules one group, kept once, under the first name)."""
    missing = missing_api()
    require_api(missing)
    units: list[FSDPUnit] = []
    for name, m in model.named_modules():
        if not is_fsdp_module(m):
            continue
        check_one_group(name, m)
        for pg in param_groups(m):
            gone = [a for a in _GROUP_READS if not hasattr(pg, a)]
            if gone:
                require_api([f"FSDPParamGroup.{a}" for a in gone])
            if not any(u.group is pg for u in units):
                units.append(FSDPUnit(name or "root", m, pg))
    return units
