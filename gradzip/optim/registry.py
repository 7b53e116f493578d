"""The registry of ``gradzip train --optimizer``: a name, a factory and a line of help each.

A factory is ``factory(groups, lr, weight_decay, freeze_step, momentum) -> torch.optim.Optimizer``
where ``groups`` are :func:`gradzip.optim.build.param_groups` of the model (each group carries an
``adapt`` key, LAMB's layer adaptation, that an optimizer without it pops). Adding an optimizer is
one module with one :func:`register_optimizer` call, imported before the parser is built (the
built-ins are registered in :mod:`gradzip.optim.build`). The names feed the ``--optimizer``
choices and help, :class:`gradzip.training.config.TrainConfig`'s check (``OPTIMIZERS``, a live
view) and :func:`gradzip.optim.build.build_optimizer`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

Factory = Callable[[list[dict[str, Any]], float, float, int, float], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerEntry:
    """One registered optimizer. ``help``: its text in ``--optimizer``'s help (None: its name;
    "": described with another entry, as onebit-lamb is with onebit-adam)."""

    name: str
    factory: Factory
    help: str | None = None


_OPTIMIZERS: dict[str, OptimizerEntry] = {}


def register_optimizer(name: str, factory: Factory, help: str | None = None) -> OptimizerEntry:
    """Register ``factory`` under ``name`` (once; :func:`unregister_optimizer` removes it)."""
    if not name or name != name.strip().lower():
        raise ValueError(f"optimizer name {name!r}: use a lower-case word")
    if name in _OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is registered already")
    entry = OptimizerEntry(name, factory, help)
    _OPTIMIZERS[name] = entry
    return entry


def unregister_optimizer(name: str) -> None:
    """Remove the optimizer registered under ``name``."""
    if name not in _OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not registered")
    del _OPTIMIZERS[name]


def _choices() -> str:
    names = list(_OPTIMIZERS)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def get_optimizer(name: str) -> OptimizerEntry:
    """The entry of ``name``; a one-line ValueError listing the registered names if there is none."""
    try:
        return _OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; choose {_choices()}") from None


def optimizer_help() -> str:
    """``--optimizer``'s help: every entry's text, in registration order, joined by "; "."""
    texts = (e.name if e.help is None else e.help for e in _OPTIMIZERS.values())
    return "; ".join(t for t in texts if t)


class OptimizerNames(Sequence[str]):
    """The registered optimizer names, in registration order: a live, read-only view (argparse
    choices, config checks)."""

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...

    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        return tuple(_OPTIMIZERS)[i]

    def __len__(self) -> int:
        return len(_OPTIMIZERS)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_OPTIMIZERS))

    def __contains__(self, name: object) -> bool:
        return name in _OPTIMIZERS

    def __repr__(self) -> str:
        return repr(tuple(_OPTIMIZERS))


OPTIMIZER_NAMES = OptimizerNames()
