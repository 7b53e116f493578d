"""Fault injection for chaos tests: ``GRADZIP_FAULT`` makes one rank fail at one step.

Spelling: one or more faults separated by ``;``, each ``KIND:step=S[,rank=R][,seconds=T]``::

    GRADZIP_FAULT="nan:step=3,rank=1"            # rank 1's gradient of step 3 gets a NaN
    GRADZIP_FAULT="inf:step=5-8"                 # rank 0, steps 5 to 8: +inf
    GRADZIP_FAULT="raise:step=4,rank=1"          # rank 1 raises an exception before step 4
    GRADZIP_FAULT="kill:step=4,rank=1"           # rank 1 SIGKILLs itself before step 4
    GRADZIP_FAULT="delay:step=2,rank=1,seconds=30"   # rank 1 sleeps 30 s before step 2 (a straggler)

``step`` counts from 1, as ``metrics.jsonl`` does (a range ``A-B`` is inclusive); ``rank`` is the
rank (the worker on ``sim``), 0 by default. ``nan``/``inf`` write one non-finite value into the
gradient of the model's first trainable parameter during backward, so the engine sees it as it
would a real overflow; the others act at the start of the step, before the forward pass. The
variable is read by every rank, so one setting reaches every process that ``gradzip train``,
``torchrun`` or ``mpirun`` starts. A bad spelling is a one-line error before anything runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gradzip.errors import GradzipError

ENV = "GRADZIP_FAULT"
KINDS = ("nan", "inf", "raise", "kill", "delay")


class InjectedFault(RuntimeError):
    """The exception that ``raise:`` injects."""


@dataclass(frozen=True)
class Fault:
    kind: str
    first: int
    last: int
    rank: int = 0
    seconds: float = 0.0

    def hits(self, step: int, rank: int) -> bool:
        return rank == self.rank and self.first <= step <= self.last


def parse_faults(text: str | None) -> list[Fault]:
    """The faults of a ``GRADZIP_FAULT`` value (empty or unset: none); one-line errors."""
    faults = []
    for part in (text or "").split(";"):
        part = part.strip()
        if part:
            faults.append(_parse_one(part))
    return faults


def _parse_one(part: str) -> Fault:
    def bad(why: str) -> GradzipError:
        return GradzipError(f"{ENV}={part!r}: {why} (e.g. nan:step=3,rank=1; kinds: {', '.join(KINDS)})")

    kind, _, params = part.partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise bad(f"unknown fault {kind!r}")
    values: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in params.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq or key not in ("step", "rank", "seconds"):
            raise bad(f"expected step=, rank= or seconds=, got {item!r}")
        if key in values:
            raise bad(f"{key}= given twice")
        values[key] = value.strip()
    if "step" not in values:
        raise bad("step= is required")
    lo, dash, hi = values["step"].partition("-")
    try:
        first, last = int(lo), int(hi if dash else lo)
        rank = int(values.get("rank", "0"))
        seconds = float(values.get("seconds", "0"))
    except ValueError:
        raise bad("step and rank are integers (step may be a range A-B), seconds a number") from None
    if not 1 <= first <= last:
        raise bad(f"step must be >= 1 (a range A-B with A <= B), got {values['step']}")
    if rank < 0:
        raise bad(f"rank must be >= 0, got {rank}")
    if kind == "delay" and not seconds > 0:
        raise bad("delay needs seconds= > 0")
    if kind != "delay" and "seconds" in values:
        raise bad(f"seconds= applies to delay, not {kind}")
    return Fault(kind, first, last, rank, seconds)


class FaultPlan:
    """The faults of one run, applied by the training loop at its two injection points."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults

    @classmethod
    def from_env(cls) -> FaultPlan:
        return cls(parse_faults(os.environ.get(ENV)))

    def before_step(self, step: int, rank: int) -> None:
        """Start of ``step`` on ``rank``: exceptions, kills and delays."""
        for f in self.faults:
            if not f.hits(step, rank):
                continue
            if f.kind == "delay":
                time.sleep(f.seconds)
            elif f.kind == "raise":
                raise InjectedFault(f"{ENV}: injected exception at step {step} on rank {rank}")
            elif f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)

    @contextlib.contextmanager
    def gradients(self, model: torch.nn.Module, step: int, rank: int) -> Iterator[None]:
        """Inside, backward of ``step`` on ``rank`` writes inf or NaN into one gradient entry."""
        values = [float("nan") if f.kind == "nan" else float("inf")
                  for f in self.faults if f.kind in ("nan", "inf") and f.hits(step, rank)]
        if not values:
            yield
            return
        param = next(p for p in model.parameters() if p.requires_grad)

        def poison(g: torch.Tensor) -> torch.Tensor:
            g = g.clone(memory_format=torch.contiguous_format)
            g.view(-1)[0] = values[0]
            return g

        if hasattr(param, "device_mesh"):  # FSDP2: the sharded parameter's hooks never fire; poison the
            # gradient of its module's output instead, which backward carries into the parameter's gradient
            owner = next(m for m in model.modules() if any(q is param for q in m.parameters(recurse=False)))

            def on_output(_m: torch.nn.Module, _i: Any, out: torch.Tensor) -> None:
                out.register_hook(poison)

            handle = owner.register_forward_hook(on_output)
        else:
            handle = param.register_hook(poison)
        try:
            yield
        finally:
            handle.remove()
