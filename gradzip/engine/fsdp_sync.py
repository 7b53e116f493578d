"""Sharded training behind the one synchronisation protocol: :class:`FSDPSync` drives a
``fully_shard``-ed model whose gradient reductions :func:`gradzip.engine.fsdp.fsdp_compress` compresses.

FSDP2 reduces the gradients inside backward (its reduce-scatter, and HSDP's replica all-reduce),
so by the time :meth:`FSDPSync.synchronize` runs, each rank's ``p.grad`` already holds its shard
of the averaged gradient. What the synchroniser adds is the protocol's bookkeeping:

1. ``worker(rank)``: zero the gradients and open a compressor step
   (:meth:`FSDPCompression.begin_step`), so that a skipped step undoes the error-memory updates
   that backward made;
2. ``no_sync()``: ``set_requires_gradient_sync(False)``, under which FSDP calls no reduction, so
   gradient accumulation compresses once per optimizer step;
3. ``synchronize()``: this rank's bytes by collective, times, and whether some reduction saw an
   inf or NaN;
4. ``commit(nonfinite)``: keep the step's compressor state and step the optimizer on the sharded
   gradients, or (some rank saw inf/NaN) undo the state and drop the gradients on every rank.

Bytes are counted per rank and per collective, as the engine counts them (ring cost,
:mod:`gradzip.comm.cost`): ``allgather`` (FSDP's parameter all-gathers, forward and backward,
counted by a pass-through wrapper of FSDP's own all-gather), ``reduce_scatter`` (1-D FSDP: gradzip's
chunked alltoall in place of the reduce-scatter; HSDP: FSDP's exact reduce-scatter inside the node,
counted from its input size) and ``allreduce`` (HSDP: gradzip's compressed all-reduce across the replicas).
The counting wrappers are installed with ``FSDPModule.set_custom_all_gather`` (and, under HSDP,
``set_custom_reduce_scatter``) and removed the same way by :meth:`FSDPSync.detach`; only
:class:`FSDPCompression`'s public attributes are read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradzip.comm.cost import allreduce_bytes, reduce_scatter_bytes
from gradzip.engine.fsdp import FSDPCompression
from gradzip.engine.fsdp_compat import AllGather, ReduceScatter
from gradzip.engine.stats import StepStats
from gradzip.engine.synchronizer import OptimizerStep


@contextlib.contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """FSDP2's gradient reduction off inside (the micro-batches of gradient accumulation before
    the last), on again after."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


class _Counted:
    """Bytes this rank sent through one kind of FSDP's own collectives."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0


class _CountingAllGather(AllGather):  # type: ignore[misc,valid-type]
    """FSDP's own all-gather, unchanged, with this rank's bytes counted: (n−1)·input, a ring's."""

    def __init__(self, inner: Any, counter: _Counted) -> None:
        self.inner, self.counter = inner, counter

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: Any, async_op: bool = False) -> Any:
        n = dist.get_world_size(group)
        self.counter.bytes += (n - 1) * input_tensor.numel() * input_tensor.element_size()
        self.counter.calls += 1
        return self.inner(output_tensor, input_tensor, group, async_op=async_op)


class _CountingReduceScatter(ReduceScatter):  # type: ignore[misc,valid-type]
    """FSDP's own reduce-scatter (HSDP's, inside the node), unchanged, with its bytes counted."""

    def __init__(self, inner: Any, counter: _Counted) -> None:
        self.inner, self.counter = inner, counter

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        n = dist.get_world_size(group)
        self.counter.bytes += reduce_scatter_bytes(input_tensor.numel() * input_tensor.element_size(), n)
        self.counter.calls += 1
        return self.inner(output_tensor, input_tensor, group, op, async_op=async_op)


class FSDPSync:
    """The :class:`gradzip.engine.synchronizer.Synchronizer` of a sharded model (module docstring).

    ``comp`` is the model's :class:`FSDPCompression`; ``rank`` this process's global rank."""

    def __init__(self, model: nn.Module, comp: FSDPCompression, rank: int) -> None:
        self.model, self.comp = model, comp
        self.worker_ids = [rank]
        self.spec = comp.spec
        self.hsdp = comp.hsdp
        self.last_schedule: list[Any] = []
        self._gathered, self._scattered = _Counted(), _Counted()
        self._saved = [u.installed() for u in comp.units]  # what detach() restores
        for unit, was in zip(comp.units, self._saved):
            unit.module.set_custom_all_gather(_CountingAllGather(was.all_gather, self._gathered))  # type: ignore[operator]
            if self.hsdp:  # the intra-node reduce-scatter stays FSDP's own: count it
                unit.module.set_custom_reduce_scatter(  # type: ignore[operator]
                    _CountingReduceScatter(was.reduce_scatter, self._scattered))
        self._t0 = time.perf_counter()
        self._mark = self._marks()

    @property
    def exchange(self) -> str:
        """HSDP: the replica all-reduce's scheme; 1-D: ``reduce-scatter`` or the compressor's own."""
        return self.comp.exchange

    @property
    def shard_size(self) -> int:
        """Ranks each parameter is sharded over."""
        return self.comp.shard_size

    eval_on_every_rank = True  # the Synchronizer protocol: a sharded forward needs every rank

    def summary(self) -> dict[str, Any]:
        """No fields of its own in ``summary.json`` (the protocol's)."""
        return {}

    def fp32_bytes(self, n_params: int) -> int:
        """Uncompressed fp32 reductions of ``n_params`` gradients: FSDP's reduce-scatter, or HSDP's
        inside the node plus an allreduce of the shard across the replicas (FSDP's padding left out)."""
        world, k, nbytes = dist.get_world_size(), self.shard_size, 4 * n_params
        if not self.hsdp:
            return reduce_scatter_bytes(nbytes, world)
        return reduce_scatter_bytes(nbytes, k) + allreduce_bytes(nbytes // k, world // k)

    def _marks(self) -> dict[str, float]:
        """Cumulative counters this rank's step figures are differences of."""
        comms = self.comp.communicators
        return {"allgather": self._gathered.bytes, "gradzip": sum(c.stats.bytes_sent for c in comms),
                "recv": sum(c.stats.bytes_recv for c in comms), "scatter": self._scattered.bytes,
                "link_s": sum(c.stats.seconds for c in comms), "reduce_s": self.comp.reduce_s}

    # ------------------------------------------------------------------ the Synchronizer protocol
    @contextlib.contextmanager
    def worker(self, wid: int) -> Iterator[None]:
        self.model.zero_grad(set_to_none=True)
        self.comp.begin_step()
        self._mark = self._marks()  # evaluation's all-gathers since the last step are no step's
        self._t0 = time.perf_counter()
        yield

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return gradient_sync_off(self.model)

    def after_backward(self, stepper: OptimizerStep) -> None:
        """Nothing: FSDP reduced the gradients inside backward."""

    def synchronize(self) -> StepStats:
        """This step's bytes by collective and its times (wall clock). ``compress_s``: gradzip's
        encodes and decodes; ``comm_s``: its collectives' time; ``compute_s``: the rest of forward
        and backward, FSDP's own all-gathers (and HSDP's intra-node reduce-scatter) included."""
        step_s = time.perf_counter() - self._t0
        now, was = self._marks(), self._mark
        self._mark = now
        d = {k: now[k] - was[k] for k in now}
        rs, ar = (d["scatter"], d["gradzip"]) if self.hsdp else (d["gradzip"], 0)
        by = {"allgather": int(d["allgather"]), "reduce_scatter": int(rs), "allreduce": int(ar)}
        sent = sum(by.values())
        comm_s = min(d["link_s"], d["reduce_s"])
        return StepStats(compute_s=max(0.0, step_s - d["reduce_s"]), compress_s=d["reduce_s"] - comm_s,
                         comm_s=comm_s, bytes_sent=sent, bytes_recv=int(d["recv"] + d["allgather"] + rs * self.hsdp),
                         step_s=step_s, clock="measured", link_s=d["link_s"], buckets=len(self.comp.units),
                         intra_bytes_sent=sent - by["allreduce"] if self.hsdp else 0,
                         nonfinite=int(self.comp.nonfinite > 0), by_collective=by)

    def commit(self, nonfinite: int, stepper: OptimizerStep) -> float:
        """Step on the sharded gradients, or undo the step on every rank (``nonfinite`` > 0)."""
        if nonfinite:
            self.comp.end_step(keep=False)
            for p in self.model.parameters():
                p.grad = None
            stepper.skip()
            return float("nan")
        self.comp.end_step(keep=True)
        return stepper.step()

    def state_dict(self) -> dict[str, Any]:
        return {"fsdp": self.comp.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.comp.load_state_dict(state["fsdp"])

    def detach(self) -> None:
        for unit, was in zip(self.comp.units, self._saved):
            unit.module.set_custom_all_gather(was.all_gather)  # type: ignore[operator]
            if self.hsdp:
                unit.module.set_custom_reduce_scatter(was.reduce_scatter)  # type: ignore[operator]
        self.comp.remove()
