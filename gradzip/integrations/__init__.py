"""gradzip inside the trainers researchers already use; each module imports its trainer on use.

- :mod:`gradzip.integrations.transformers`: ``GradzipCallback`` for the Hugging Face ``Trainer``
  (the ``hf`` extra);
- :mod:`gradzip.integrations.lightning`: ``GradzipCallback`` for Lightning's ``DDPStrategy``
  (the ``lightning`` extra);
- accelerate needs no adapter: register :func:`gradzip.ddp_hook` on the prepared model.

All of them go through the DDP communication hook (:mod:`gradzip.engine.ddp`) and report the
hook's figures (:meth:`GradzipHookState.stats`) under keys that start with ``gradzip/``.

Without its extra, importing an integration raises :class:`MissingExtra` (an ``ImportError``), one
line that names the extra to install; the example scripts print that line and exit 2
(:func:`exit_if_missing`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from gradzip.engine.ddp import GradzipHookState
from gradzip.errors import GradzipError

PREFIX = "gradzip/"
# The extra that installs each trainer package (pyproject.toml, [project.optional-dependencies]).
EXTRAS = {"transformers": "hf", "accelerate": "hf", "datasets": "hf", "lightning": "lightning",
          "pytorch_lightning": "lightning", "lightning_fabric": "lightning"}


class MissingExtra(GradzipError, ImportError):
    """A trainer package is not installed: the message names the extra that brings it."""


def install_hint(where: str, error: ModuleNotFoundError, default_extra: str) -> str:
    """One line: what needs which missing module, and the pip command of the extra that brings it."""
    missing = (error.name or "").split(".")[0] or "a package"
    extra = EXTRAS.get(missing, default_extra)
    return (f"{where} needs {missing}, which is not installed: pip install -e \".[{extra}]\" in a clone of "
            f"gradzip (or pip install \"gradzip[{extra}]\")")


def missing_extra(where: str, error: ModuleNotFoundError, default_extra: str) -> MissingExtra:
    """The :class:`MissingExtra` to raise (``from None``) for a failed import of a trainer package."""
    if (error.name or "").split(".")[0] == "gradzip":
        raise error  # a broken gradzip install, not a missing extra
    return MissingExtra(install_hint(where, error, default_extra))


@contextlib.contextmanager
def exit_if_missing(where: str, default_extra: str) -> Iterator[None]:
    """For scripts: a trainer package missing inside the block prints one line with the install
    command on stderr (on rank 0 only under a launcher) and exits with code 2, instead of a traceback."""
    try:
        yield
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "gradzip":
            raise
        _exit(install_hint(where, e, default_extra))
    except MissingExtra as e:
        _exit(str(e))


def _exit(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {line}", file=sys.stderr)
    sys.exit(2)


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
