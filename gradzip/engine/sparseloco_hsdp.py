"""``--sync sparseloco --hsdp``: SparseLoCo over HSDP, each rank keeping the error memory of its own shard.

Layout (:func:`gradzip.training.sharding.shard_model`): a 2-D mesh of R replicas × K ranks, ranks
``r // K`` forming a node; every module is ``fully_shard``-ed over its node's K ranks, and nothing is
all-reduced across the nodes between syncs. So each node is one SparseLoCo replica, which its K
ranks train together: every inner step, FSDP's exact reduce-scatter averages the node's gradients
into each rank's shard, and the inner optimizer steps the shards. A step whose gradient is not
finite on some rank of a node is skipped by the whole node (one flag all-reduced over the node),
as a DiLoCo worker skips alone.

Every H steps, on every rank, for its shard of each parameter (the DTensor's local tensor: FSDP2
shards dimension 0, so a rank holds a block of each weight's rows), with Δ = θ_global − θ_local:

1. e ← β·e + Δ, ĉ = Q(TopK per chunk(e)), e ← e − decode(ĉ): the ``sparseloco`` codec and its
   error feedback (:mod:`gradzip.engine.sparseloco`), on the shard. The chunks are those of the
   shard's shape (h × w blocks of the rows this rank holds; :func:`gradzip.compress.indexcode.plan`),
   not of the whole tensor's: they are the unsharded run's when K divides a tensor's rows into
   multiples of its chunk height;
2. ĉ is allgathered over the replica group (the rank holding the same shard on every node: the
   same shapes, so the same payload size) and aggregated (the scatter-mean over the replicas);
3. θ_global ← θ_global − α·aggregate (SGD without momentum), θ_local ← θ_global.

Memory per rank: θ_global and the error memory, each the size of the rank's shard (1/K of the
model; ``ef_dtype=bf16``: the memory at 2 bytes an element). Checkpoints are per rank: θ_global,
the error memory, and, since the nodes differ between syncs, the rank's own shard of the
parameters and of the inner optimizer's state (the shared file holds rank 0's node).
Bytes: FSDP's all-gathers and reduce-scatter stay inside the node (``bytes_allgather``,
``bytes_reduce_scatter``); the sync's allgather is the only traffic across the nodes, counted as
``bytes_allreduce`` (HSDP's exchange across the replicas). ``overlap=1`` is not supported here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from gradzip.comm.cost import allreduce_bytes, reduce_scatter_bytes
from gradzip.comm.torch_backend import DEFAULT_TIMEOUT_S, TorchCommunicator
from gradzip.compress.registry import create
from gradzip.engine.fsdp_compat import fsdp_units
from gradzip.engine.fsdp_sync import _Counted, _CountingAllGather, _CountingReduceScatter, gradient_sync_off
from gradzip.engine.handshake import check_agreement, fingerprint
from gradzip.engine.modes import SyncSettings, register_sync
from gradzip.engine.schemes import SchemeState
from gradzip.engine.sparseloco import codec_spec, keep_memory_in, memory_dtype
from gradzip.engine.stats import StepStats
from gradzip.engine.synchronizer import OptimizerStep
from gradzip.errors import GradzipError
from gradzip.plan.sync import SyncSpec


def _local(p: Tensor) -> Tensor:
    """The tensor this rank holds of ``p`` (a DTensor's local shard, sharing its storage; call under
    ``no_grad``); a plain tensor as it is."""
    return p.to_local() if hasattr(p, "to_local") else p


class HSDPSparseLoCo:
    """The :class:`gradzip.engine.synchronizer.Synchronizer` of ``--sync sparseloco --hsdp`` (module
    docstring). ``model``: sharded over the node (``fully_shard(mesh=mesh["shard"])``), with no
    replica all-reduce attached; ``replicas``: the replica process group; ``rank``: the global rank."""

    eval_on_every_rank = True  # a sharded forward needs every rank of the node

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sync: SyncSpec, replicas: Any, rank: int,
                 *, timeout: float | None = None, agree: dict[str, Any] | None = None) -> None:
        if sync.overlap:
            raise GradzipError("--sync sparseloco --hsdp: overlap=1 is not supported (the sharded sync waits for "
                               "its exchange); drop overlap or run without --hsdp")
        self.model, self.inner, self.sync = model, optimizer, sync
        self.worker_ids, self.last_schedule = [rank], []
        self.spec = codec_spec(sync)
        self.compressor = create(self.spec)
        keep_memory_in([self.compressor], memory_dtype(sync))
        self.units = [u for u in fsdp_units(model)]
        if not self.units or any(u.native_hsdp for u in self.units):
            raise GradzipError("--sync sparseloco --hsdp: shard the model over the node alone "
                               "(fully_shard(mesh=mesh['shard'])), with no replication of its own")
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        wait = DEFAULT_TIMEOUT_S if timeout is None else timeout
        self.comm = TorchCommunicator.adopt(replicas, timeout=wait)  # the same shard on every node
        self.node = TorchCommunicator.adopt(self.units[0].shard_group, timeout=wait)  # this rank's node
        with torch.no_grad():
            shards = [(n, _local(p)) for n, p in self.named]
        doc = fingerprint(shards, self.spec, {"sync": str(sync), "replicas": self.comm.world_size}, agree or {})
        check_agreement([self.comm], [doc])
        self.comm.stats.reset()
        self.scheme = SchemeState(self.compressor, self.comm)
        with torch.no_grad():
            self.global_ = [t.clone() for _, t in shards]  # θ_global: this rank's shard of it
        self.step = 0
        self._gathered, self._scattered = _Counted(), _Counted()
        self._saved = [u.installed() for u in self.units]
        for unit, was in zip(self.units, self._saved):  # count FSDP's own collectives, unchanged
            unit.module.set_custom_all_gather(_CountingAllGather(was.all_gather, self._gathered))  # type: ignore[operator]
            unit.module.set_custom_reduce_scatter(  # type: ignore[operator]
                _CountingReduceScatter(was.reduce_scatter, self._scattered))
        self._t0, self._mark = time.perf_counter(), (0, 0)
        self._norms: list[float] = []
        self._bad = 0

    # ------------------------------------------------------------------ figures
    @property
    def exchange(self) -> str:
        return "allgather"

    @property
    def memory_numel(self) -> int:
        """Elements of this rank's error memory (its shard's, once the first sync made it)."""
        return sum(m.numel() for mems in self.compressor.memory.values() for m in mems)

    def summary(self) -> dict[str, Any]:
        return {}

    def fp32_bytes(self, n_params: int) -> int:
        """HSDP's uncompressed fp32 reductions of a step: the reduce-scatter inside the node and an
        allreduce of the shard across the replicas (FSDP's padding left out)."""
        k, r, nbytes = self.node.world_size, self.comm.world_size, 4 * n_params
        return reduce_scatter_bytes(nbytes, k) + allreduce_bytes(nbytes // k, r)

    # ------------------------------------------------------------------ the Synchronizer protocol
    @contextlib.contextmanager
    def worker(self, wid: int) -> Iterator[None]:
        self.model.zero_grad(set_to_none=True)
        self._mark = (self._gathered.bytes, self._scattered.bytes)  # evaluation's all-gathers are no step's
        self._t0 = time.perf_counter()
        yield

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return gradient_sync_off(self.model)

    def after_backward(self, stepper: OptimizerStep) -> None:
        """The node's inner step on its reduced gradients, or a skip by every rank of the node when
        some rank's shard of the gradient is not finite."""
        with torch.no_grad():
            sums = [torch.sum(_local(p.grad), dtype=torch.float32) for _, p in self.named if p.grad is not None]
            flag = torch.tensor([0.0 if not sums or bool(torch.isfinite(torch.stack(sums).sum())) else 1.0])
        if self.node.allreduce(flag)[0].item() == 0:
            self._norms.append(stepper.step())
        else:
            stepper.skip()
            self._bad += 1

    def synchronize(self) -> StepStats:
        """The step's bytes (FSDP's inside the node), and every H steps the sync across the nodes."""
        step_s = time.perf_counter() - self._t0
        self.step += 1
        sent = recv = 0
        link = work = 0.0
        if self.step % self.sync.every == 0:
            snap, t0 = self.comm.stats.snapshot(), time.perf_counter()
            self._outer()
            work = time.perf_counter() - t0
            d = self.comm.stats.since(snap)
            sent, recv, link = int(d["bytes_sent"]), int(d["bytes_recv"]), float(d["seconds"])
        gathered, scattered = self._gathered.bytes - self._mark[0], self._scattered.bytes - self._mark[1]
        inside = gathered + scattered
        comm_s = min(link, work)
        return StepStats(compute_s=step_s, compress_s=work - comm_s, comm_s=comm_s, bytes_sent=inside + sent,
                         bytes_recv=inside + recv, step_s=step_s + work, clock="measured", link_s=link,
                         buckets=len(self.units), intra_bytes_sent=inside, nonfinite=self._bad,
                         syncs=int(self.step % self.sync.every == 0),
                         by_collective={"allgather": gathered, "reduce_scatter": scattered, "allreduce": sent})

    def commit(self, nonfinite: int, stepper: OptimizerStep) -> float:
        """Nothing left to decide (each node stepped or skipped alone): the mean gradient norm."""
        norms, self._norms, self._bad = self._norms, [], 0
        return sum(norms) / len(norms) if norms else float("nan")

    @torch.no_grad()
    def _outer(self) -> None:
        """Steps 1-3 of the module docstring on this rank's shards."""
        locals_ = [_local(p) for _, p in self.named]
        deltas = [torch.sub(g, t) for g, t in zip(self.global_, locals_)]
        self.compressor.begin_step()
        ex = self.scheme.exchange(self.compressor, deltas, "shard")
        ex.start()
        while not ex.advance():
            pass
        self.compressor.end_step(True)
        for g, t, agg in zip(self.global_, locals_, ex.result()):
            g.add_(agg.to(g.dtype), alpha=-self.sync.alpha)
            t.copy_(g)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's state (tensors and numbers): θ_global's shard, the error memory, and this
        rank's shards of the parameters and of the inner optimizer's state."""
        with torch.no_grad():
            local = [_local(p).clone() for _, p in self.named]
            inner = {str(i): {k: (_local(v).clone() if isinstance(v, Tensor) else v)
                              for k, v in self.inner.state[p].items()}
                     for i, (_, p) in enumerate(self.named) if p in self.inner.state}
        return {"spec": self.spec, "sync": str(self.sync), "mesh": [self.node.world_size, self.comm.world_size],
                "step": self.step, "global": [g.clone() for g in self.global_], "local": local, "inner": inner,
                "compressor": self.compressor.state_dict(), "scheme": self.scheme.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        want = (self.spec, str(self.sync), [self.node.world_size, self.comm.world_size])
        got = (sd.get("spec"), sd.get("sync"), [int(x) for x in sd.get("mesh", [])])
        if got != want:
            raise GradzipError(f"SparseLoCo state is for {got[0]!r} with sync {got[1]!r} on a mesh of {got[2]} (node, "
                               f"replicas), not {want[0]!r} with {want[1]} on {want[2]}; resume with the same settings")
        self.step = int(sd["step"])
        with torch.no_grad():
            for g, s in zip(self.global_, sd["global"], strict=True):
                g.copy_(s)
            for (_, p), s in zip(self.named, sd["local"], strict=True):
                _local(p).copy_(s)
            for i, (_, p) in enumerate(self.named):
                for k, v in sd["inner"].get(str(i), {}).items():
                    live = self.inner.state[p].get(k)
                    if isinstance(live, Tensor):
                        _local(live).copy_(v)
                    elif isinstance(v, Tensor):  # a sharded state is made by loading the full one first
                        raise GradzipError(f"SparseLoCo state: the inner optimizer has no {k!r} for parameter "
                                           f"{self.named[i][0]}; load the model's and optimizer's full state first")
                    else:
                        self.inner.state[p][k] = v
        self.compressor.load_state_dict(sd["compressor"])
        self.scheme.load_state_dict(sd["scheme"])

    def detach(self) -> None:
        for unit, was in zip(self.units, self._saved):
            unit.module.set_custom_all_gather(was.all_gather)  # type: ignore[operator]
            unit.module.set_custom_reduce_scatter(was.reduce_scatter)  # type: ignore[operator]
        self.comm.close()
        self.node.close()


def _build(model: nn.Module, optimizer: torch.optim.Optimizer, target: Any, s: SyncSettings) -> HSDPSparseLoCo:
    return HSDPSparseLoCo(model, optimizer, s.sync, s.replicas, getattr(target, "rank", 0), timeout=s.timeout,
                          agree=s.engine.agree)


register_sync("sparseloco+hsdp", "--sync sparseloco --hsdp: SparseLoCo across the nodes, each rank's error memory "
              "its own shard", _build)
