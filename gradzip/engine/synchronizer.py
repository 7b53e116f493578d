"""The one synchronisation protocol: what a training loop calls, whatever keeps the workers in step.

Three kinds of synchronisation implement it:

- :class:`gradzip.engine.Engine`: a compressed exchange of the gradients at every step (DDP-like);
- :class:`gradzip.engine.diloco.DiLoCo` (and LocalSGD, Streaming DiLoCo): every worker steps its
  own inner optimizer, and every H steps the pseudo-gradients are exchanged and an outer step
  merges them;
- :class:`gradzip.engine.fsdp_sync.FSDPSync`: sharded training (FSDP2/HSDP), whose reductions run
  inside backward, compressed by :func:`gradzip.engine.fsdp.fsdp_compress`.

A loop over one optimizer step reads the same for all of them (``gradzip train`` is this loop)::

    for w in sync.worker_ids:                # sim: every worker in turn; real backends: this rank
        with sync.worker(w):                 # w's state in; .grad zeroed
            for micro in range(k):           # gradient accumulation: exchange after the last one
                with sync.no_sync() if micro < k - 1 else contextlib.nullcontext():
                    loss(model, batch(w, micro)).backward()
            sync.after_backward(stepper)     # local-step modes step (or skip) w's optimizer here
    stats = sync.synchronize()               # the exchange: bytes, times, non-finite workers
    bad = allreduce(stats.nonfinite)         # every rank takes the same decision
    grad_norm = sync.commit(bad, stepper)    # per-step modes: the optimizer steps, or all skip

``stepper`` is the loop's :class:`OptimizerStep`: the synchroniser decides *whether* and *when*
the optimizer steps; the loop keeps *how* (mixed precision, clipping).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor

    from gradzip.cluster.schedule import Span
    from gradzip.engine.stats import StepStats
    from gradzip.plan.buckets import Bucket


class OptimizerStep(Protocol):
    """How the loop steps its optimizer on the gradients in ``p.grad``."""

    def step(self, clip: bool = True) -> float:
        """One optimizer step (unscale, clip unless ``clip=False``, step); returns the gradient
        norm before clipping."""
        ...

    def skip(self) -> None:
        """A step not taken because a gradient was not finite (fp16 backs its loss scale off)."""
        ...


@runtime_checkable
class Synchronizer(Protocol):
    """What keeps the workers' models in step. See the module docstring for the loop that drives it.

    worker_ids: the workers this process hosts (sim: all N; real backends: ``[rank]``).
    spec: the compressor's canonical spec. exchange: its exchange scheme's name.
    last_schedule: the last step's spans (encodes, waits, decodes, link rounds), or ``[]``.
    eval_on_every_rank: evaluation runs on every rank (a sharded model's forward needs them all),
    not on rank 0 alone.
    """

    worker_ids: list[int]
    spec: str
    last_schedule: list[Span]
    eval_on_every_rank: bool

    def summary(self) -> dict[str, Any]:
        """The mode's own fields for ``summary.json`` (``{}`` when it has none)."""
        ...

    def fp32_bytes(self, n_params: int) -> int:
        """Bytes one rank would send per step to reduce ``n_params`` fp32 gradients uncompressed
        in this mode's layout: the baseline of the run's compression figure."""
        ...

    @property
    def exchange(self) -> str: ...

    def worker(self, wid: int) -> AbstractContextManager[Any]:
        """Run worker ``wid``'s forward, backward and :meth:`after_backward` inside. Zeroes ``.grad``
        on entry; sim: swaps worker ``wid``'s state (replica, compressor, optimizer state) in."""
        ...

    def no_sync(self) -> AbstractContextManager[None]:
        """Gradient accumulation: inside, backward only accumulates into ``.grad``."""
        ...

    def after_backward(self, stepper: OptimizerStep) -> None:
        """Worker's last backward of the step is done. Local-step modes step its optimizer here, or
        skip it alone when its gradient is not finite; per-step modes do nothing."""
        ...

    def synchronize(self) -> StepStats:
        """Every hosted worker ran: finish the step's communication and report its bytes, times,
        ``nonfinite`` (workers here whose gradient had an inf or NaN) and ``syncs``."""
        ...

    def commit(self, nonfinite: int, stepper: OptimizerStep) -> float:
        """The skip decision, with ``nonfinite`` summed over every rank: per-step modes step the
        optimizer on the averaged gradient, or undo the step everywhere when it is > 0. Returns the
        gradient norm (NaN when no step was taken)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def detach(self) -> None:
        """Remove every hook: the model trains as if the synchroniser had never been attached."""
        ...


@dataclass(frozen=True)
class ExchangePlan:
    """What the per-step engine exchanges this step, as an optimizer that compresses something
    other than the gradient wants it. ``compress=False``: every bucket goes uncompressed (1-bit
    Adam's warm-up). ``transform(bucket, buffer)``: turns a bucket's local gradient, in place and
    before compression, into what is exchanged instead (1-bit Adam's local momentum)."""

    compress: bool = True
    transform: Callable[[Bucket, Tensor], None] | None = None


@runtime_checkable
class ShapesExchange(Protocol):
    """An optimizer that decides what the engine exchanges (1-bit Adam/LAMB, DeMo). The engine asks
    for the plan at the start of every step; ``grad_is_update`` says that ``p.grad`` then holds
    something that must not be clipped (the averaged momentum)."""

    def exchange_plan(self) -> ExchangePlan: ...

    @property
    def grad_is_update(self) -> bool: ...
