"""gradzip inside the trainers researchers already use; each module imports its trainer on use.

- :mod:`gradzip.integrations.transformers`: ``GradzipCallback`` for the Hugging Face ``Trainer``
  (the ``hf`` extra);
- :mod:`gradzip.integrations.lightning`: ``GradzipCallback`` for Lightning's ``DDPStrategy``
  (the ``lightning`` extra);
- accelerate needs no adapter: register :func:`gradzip.ddp_hook` on the prepared model.

All of them go through the DDP communication hook (:mod:`gradzip.engine.ddp`) and report the
hook's figures (:meth:`GradzipHookState.stats`) under keys that start with ``gradzip/``.
"""

from __future__ import annotations

from typing import Any

from gradzip.engine.ddp import GradzipHookState

PREFIX = "gradzip/"


def log_figures(state: GradzipHookState) -> dict[str, float]:
    """The hook's figures since the last call, as ``gradzip/<name>`` keys (empty before a step)."""
    return {PREFIX + k: float(v) for k, v in state.stats().items()}


def rank_file(rank: int) -> str:
    """The name of a rank's hook state inside a trainer's checkpoint directory."""
    return f"gradzip-rank{rank}.pt"


def check_state(obj: Any, where: str) -> dict[str, Any]:
    """``obj`` as a hook state dict, or a one-line error naming ``where`` it came from."""
    from gradzip.errors import GradzipError

    if not isinstance(obj, dict) or "spec" not in obj:
        raise GradzipError(f"{where} does not hold a gradzip hook state")
    return obj
