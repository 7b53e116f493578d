"""``ddp_hook()``: the ``(state, hook)`` pair for ``DistributedDataParallel.register_comm_hook``,
for one compressor (:class:`gradzip.engine.ddp.GradzipHookState`) or for the ``auto`` policy
(:class:`gradzip.engine.ddp_auto.AutoHookState`); the hook is the same function for both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from gradzip.compress.base import Compressor
from gradzip.engine.ddp import GradzipHookState, gradzip_comm_hook
from gradzip.engine.ddp_auto import AutoHookState
from gradzip.errors import GradzipError
from gradzip.plan.auto import is_auto


def ddp_hook(spec: str | Compressor, process_group: Any = None, min_compress_numel: int = 1024,
             timeout: float | None = None, log: str | Path | None = None) -> tuple[GradzipHookState, Any]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``. Call it on every
    rank. With the process group up it binds at once (builds a communicator and checks that every
    rank passed the same spec); before that it binds at the hook's first call. ``log``: where the
    ``auto`` policy's rank 0 writes ``policy.jsonl`` (only with ``auto``)."""
    if process_group is not None and (not dist.is_initialized() or process_group is not dist.group.WORLD):
        raise GradzipError("ddp_hook: only the default process group is supported (pass process_group=None)")
    # A bad spec fails here, before any collective.
    if is_auto(spec):
        state: GradzipHookState = AutoHookState(str(spec), None, min_compress_numel, timeout, log)
    elif log is not None:
        raise GradzipError(f"ddp_hook: log= is the auto policy's policy.jsonl; {spec!r} is not auto (drop log=)")
    else:
        state = GradzipHookState(spec, None, min_compress_numel, timeout)
    if dist.is_available() and dist.is_initialized():
        state.bind()
    return state, gradzip_comm_hook
