"""Communication: the Communicator contract and its backends.

- ``sim``: :class:`SimWorld` — N virtual workers in one process, modelled α–β time.
- ``torch``: :class:`~gradzip.comm.torch_backend.TorchCommunicator` — Gloo (CPU) / NCCL (CUDA).
- ``mpi``: :class:`~gradzip.comm.mpi_backend.MPICommunicator` — mpi4py (imported only when used,
  so ``import gradzip.comm`` never needs mpi4py).

``init_communicator(backend, timeout)`` builds the right one from the launcher's environment
(torchrun, mpirun/mpiexec, srun); ``spawn_local`` starts N local ranks.
"""

from __future__ import annotations

import importlib
from typing import Any

from gradzip.comm.base import (
    DEFAULT_TIMEOUT_S,
    CommStats,
    Communicator,
    DoneHandle,
    Handle,
    OpTotals,
    ReduceOp,
)
from gradzip.comm.launch import LauncherEnv, detect_launcher_env, expand_nodelist, init_communicator, spawn_local
from gradzip.comm.sim import SimCommunicator, SimWorld

__all__ = [
    "DEFAULT_TIMEOUT_S", "CommStats", "Communicator", "DoneHandle", "Handle", "OpTotals", "ReduceOp",
    "LauncherEnv", "detect_launcher_env", "expand_nodelist", "init_communicator", "spawn_local",
    "SimCommunicator", "SimWorld", "TorchCommunicator", "MPICommunicator",
]

_LAZY = {
    "TorchCommunicator": "gradzip.comm.torch_backend",
    "MPICommunicator": "gradzip.comm.mpi_backend",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gradzip.comm' has no attribute {name!r}")
