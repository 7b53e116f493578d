"""Compression for sharded training: every gradzip compressor inside FSDP2 (``fully_shard``).

Example (every rank, after ``fully_shard`` on the submodules and the root)::

    comp = gradzip.fsdp_compress(model, "topk:ratio=0.1,ef=true")
    ...                                   # train as usual
    comp.bytes_sent, comp.stats           # this rank's traffic through gradzip
    comp.remove()                         # FSDP's own collectives again

Two placements, chosen by ``replicate``:

- ``replicate=None`` (1-D FSDP): gradzip replaces each FSDP module's **reduce-scatter**
  (``FSDPModule.set_custom_reduce_scatter``). FSDP hands it the flat reduce-scatter input, whose
  chunk ``j`` (``numel / n`` elements, FSDP pads it) is rank ``j``'s shard. On each of n ranks:

  1. compress each chunk ``j`` of the input under the key ``<module>/<j>`` (with the error memory
     of that key when the spec has ``ef=true``: one memory the size of the input per module);
  2. an alltoall sends chunk ``j``'s payload to rank ``j`` (the first half of the ``twophase``
     scheme: :class:`gradzip.engine.schemes.ReduceScatterExchange` does steps 1-4);
  3. rank ``j`` combines the n payloads of its shard: compressors whose payloads sum elementwise
     (``collective == "allreduce"``: ``none``, ``fp16``, ``bf16``, random-k) average the payloads
     and decode once; the others (sign codes, top-k, quantisers) decode each payload and combine
     them with the compressor's ``aggregate`` (the mean; signSGD's majority vote);
  4. the mean is scaled to what FSDP asked for with ``op``: ``AVG`` keeps it, ``SUM`` multiplies it
     by n, a custom gradient divide factor f (``PREMUL_SUM``) by n/f. ``none`` sums the payloads
     themselves and divides once, as Gloo's reduce-scatter does: bit-identical to plain FSDP2 for
     two ranks (and for any n with integer-valued gradients).

  Per-rank traffic is the payload once, (n-1)/n of it, as a ring reduce-scatter of the payload.

  Compressors that are not :func:`chunkable` (several rounds, per matrix, or a payload size that
  depends on the data: PowerSGD, ``threshold``) instead run their own exchange (their collective,
  or the spec's ``exchange=``) on every chunk of the input, as DDP would on the whole gradient, and
  each rank keeps the mean of its own chunk. PowerSGD compresses each parameter's padded shard in
  each chunk as a matrix (FSDP2 shards dimension 0: a block of the weight's rows), under one key
  per module. The traffic is then that exchange's (an allreduce of PowerSGD's factors for every
  block), not a reduce-scatter's.
- ``replicate=<ProcessGroup or 1-D DeviceMesh>`` (HSDP): the user shards over the intra-node mesh;
  FSDP's own reduce-scatter runs inside the node, and gradzip all-reduces each reduced shard across
  the replicas (``FSDPModule.set_all_reduce_hook``) with the compressor's own exchange (or the
  spec's ``exchange=``) through :class:`gradzip.engine.exchange.Exchange` over a communicator on
  that group. Error memory is kept per shard. With ``none`` it equals native HSDP.

Error feedback (``ef=true``) keeps its memory in fp32; ``ef_dtype=torch.bfloat16`` keeps it in
bf16 instead (:class:`gradzip.compress.ef.ErrorFeedback`'s ``memory_dtype``), half the memory.

Everything is installed through ``FSDPModule``'s public setters; the reads of torch's private FSDP
state that remain (the setters' base classes, each module's parameter group, and the communication
that :meth:`FSDPCompression.remove` restores) live in :mod:`gradzip.engine.fsdp_compat`.

Gradient accumulation needs nothing: under ``set_requires_gradient_sync(False)`` FSDP calls
neither hook, so compression happens once per optimizer step. Every collective goes through a
:class:`gradzip.comm.torch_backend.TorchCommunicator` adopted on FSDP's (or the replica) group:
it has a timeout, and its errors name the lost rank. Every compressor works in both placements;
under HSDP, PowerSGD compresses each parameter's local shard (a matrix of its rows).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradzip.cluster.sharded import chunkable
from gradzip.comm.base import Communicator
from gradzip.comm.torch_backend import TorchCommunicator
from gradzip.compress.base import Compressor, unflatten
from gradzip.compress.ef import ErrorFeedback
from gradzip.compress.registry import create
from gradzip.engine.fsdp_compat import FSDPUnit, ReduceScatter, fsdp_units, is_fsdp_module
from gradzip.engine.handshake import check_agreement, fingerprint
from gradzip.engine.schemes import ReduceScatterExchange, SchemeState
from gradzip.errors import GradzipError, SpecError

_AVG, _SUM = dist.ReduceOp.AVG, dist.ReduceOp.SUM


class _GradzipReduceScatter(ReduceScatter):  # type: ignore[misc,valid-type]
    """FSDP's reduce-scatter for one FSDP module, through gradzip (see the module docstring)."""

    def __init__(self, owner: FSDPCompression, unit: FSDPUnit) -> None:
        self.owner, self.unit, self.key = owner, unit, unit.key
        self.shapes = unit.shard_shapes

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        t0 = time.perf_counter()
        comm = self.owner._comm_for(group)
        mean_scale, sum_scale = _scales(op, comm.world_size, self.unit.divide_factor)
        if chunkable(self.owner.compressor):
            out = self.owner._reduce_chunks(comm, input_tensor, self.key, mean_scale, sum_scale)
        else:
            out = self.owner._reduce_whole(comm, input_tensor, self.key, self.shapes, mean_scale)
        output_tensor.copy_(out.view(output_tensor.shape))
        self.owner.reduce_s += time.perf_counter() - t0
        return None  # synchronous: the result is in output_tensor, and FSDP waits on nothing


def _scales(op: Any, n: int, factor: float | None) -> tuple[float, float | None]:
    """``(multiplier of the mean, divisor of the sum)`` that give what ``op`` asks for; the second is
    what an identity payload uses (its sum then divided once, as Gloo does), None for no division."""
    if op == _AVG:
        return 1.0, float(n)
    if op == _SUM:
        return float(n), None
    if factor is None:  # PREMUL_SUM without a factor that FSDP set: nothing to honour it by
        raise GradzipError(f"fsdp_compress: unsupported reduce op {op!r} in FSDP's reduce-scatter")
    return n / float(factor), float(factor)


class FSDPCompression:
    """What :func:`fsdp_compress` returns: the registration on every FSDP module of a model.

    ``bytes_sent``: this rank's bytes through gradzip's collectives (counted as the engine counts
    them, by :mod:`gradzip.comm.cost`); ``stats``: per collective, ``calls`` and ``bytes``;
    ``state_dict()``/``load_state_dict()``: the compressor's state (error memory, counters);
    ``remove()``: FSDP's own collectives again.

    For a synchroniser on top (:class:`gradzip.engine.fsdp_sync.FSDPSync`): ``units``, the FSDP
    modules served (:class:`gradzip.engine.fsdp_compat.FSDPUnit`, in the model's order);
    ``communicators``, gradzip's communicators (their ``stats`` count its traffic); ``hsdp``,
    ``exchange`` and ``shard_size``; ``reduce_s`` and ``nonfinite``."""

    def __init__(self, model: nn.Module, spec: str, replicate: Any = None,
                 ef_dtype: torch.dtype | None = None, timeout: float = 300.0,
                 agree: dict[str, Any] | None = None) -> None:
        self.compressor = _build(spec, ef_dtype)
        self.nonfinite = 0  # reductions since begin_step() whose input held an inf or NaN
        self.reduce_s = 0.0  # seconds in gradzip's reductions (encode, collectives, decode), cumulative
        self._spec_in = spec
        self.spec = self.compressor.spec
        self.ef_dtype = ef_dtype
        self.units: list[FSDPUnit] = _fsdp_units(model)
        self._comms: list[tuple[Any, TorchCommunicator]] = []
        self._scheme: SchemeState | None = None  # HSDP's replica all-reduce
        self._rs_schemes: dict[int, SchemeState] = {}  # 1-D, compressors that are not chunkable: per group
        self._removed = False
        self._saved = [u.installed() for u in self.units]  # what remove() restores
        again = [u.key for u, now in zip(self.units, self._saved)
                 if isinstance(now.reduce_scatter, _GradzipReduceScatter) or now.all_reduce_hook is not None]
        if again:
            raise GradzipError(f"fsdp_compress: module {again[0]!r} already has gradzip (or another all-reduce hook) "
                               "attached; call remove() on the first one before attaching again")
        hsdp = [u.key for u in self.units if u.native_hsdp]
        if hsdp:
            raise GradzipError(f"fsdp_compress: module {hsdp[0]!r} is sharded with native HSDP (a 2-D mesh); "
                               "shard over the intra-node mesh and pass replicate=<the replica group>")
        rgroup = _replica_group(replicate)
        if rgroup is not None:
            _check_replicas(self.units, rgroup)
        for unit in self.units:  # adopt each group once, in the modules' order (the same on every rank)
            group = rgroup if rgroup is not None else unit.shard_group
            if not any(g is group for g, _ in self._comms):
                self._comms.append((group, TorchCommunicator.adopt(group, timeout=timeout)))
        self._agree(rgroup is not None, agree or {})
        if rgroup is not None:
            self._scheme = SchemeState(self.compressor, self._comms[0][1])
        elif not chunkable(self.compressor):
            self._rs_schemes = {i: SchemeState(self.compressor, comm) for i, (_, comm) in enumerate(self._comms)}
        for unit in self.units:  # FSDP2's public setters
            if rgroup is None:
                unit.module.set_custom_reduce_scatter(_GradzipReduceScatter(self, unit))  # type: ignore[operator]
            else:
                unit.module.set_all_reduce_hook(self._replica_hook(unit.key, unit.shard_shapes))  # type: ignore[operator]

    # -- what a synchroniser reads -------------------------------------------------------
    @property
    def communicators(self) -> list[TorchCommunicator]:
        """gradzip's communicators (one per process group it reduces over), in adoption order."""
        return [comm for _, comm in self._comms]

    @property
    def hsdp(self) -> bool:
        """True when gradzip all-reduces across replicas (``replicate=``), False for 1-D FSDP."""
        return self._scheme is not None

    @property
    def exchange(self) -> str:
        """The exchange of the compressed gradients: HSDP's replica scheme (``allreduce``,
        ``twophase``, ...), or under 1-D FSDP ``reduce-scatter`` (chunkable compressors) or the
        compressor's own exchange."""
        if self._scheme is not None:
            return self._scheme.scheme
        return "reduce-scatter" if chunkable(self.compressor) else self.compressor.exchange

    @property
    def shard_size(self) -> int:
        """Ranks each parameter is sharded over."""
        return int(self.units[0].shard_group.size()) if self.units else 1

    def _agree(self, hsdp: bool, agree: dict[str, Any]) -> None:
        """One line on every rank unless all ranks passed the same spec, options, FSDP modules and
        caller's settings ``agree`` (else payloads would not match). Its bytes are start-up, not
        gradient traffic: not counted."""
        doc = fingerprint([], self.spec, {"ef_dtype": str(self.ef_dtype), "hsdp": hsdp},
                          {"fsdp modules": [u.key for u in self.units], **agree})
        try:
            for _, comm in self._comms:
                check_agreement([comm], [doc])
                comm.stats.reset()
        except BaseException:
            for _, comm in self._comms:
                comm.close()
            raise

    # -- the two placements ----------------------------------------------------------
    def _comm_for(self, group: Any) -> Communicator:
        for g, comm in self._comms:
            if g is group:
                return comm
        ranks = dist.get_process_group_ranks(group)
        raise GradzipError(f"fsdp_compress: FSDP reduce-scattered over the group of global ranks {ranks}, "
                           "which it did not use when gradzip was attached; call fsdp_compress again")

    @torch.no_grad()
    def _reduce_chunks(self, comm: Communicator, flat: Tensor, key: str, mean_scale: float,
                       sum_div: float | None) -> Tensor:
        """This rank's chunk of the reduced ``flat`` (steps 1-4 of the module docstring)."""
        self._check_finite(flat)
        return _run(ReduceScatterExchange(self.compressor, comm, [flat], key, (mean_scale, sum_div)))[0]

    @torch.no_grad()
    def _reduce_whole(self, comm: Communicator, flat: Tensor, key: str, shapes: list[torch.Size],
                      mean_scale: float) -> Tensor:
        """This rank's chunk of the mean of ``flat``, for compressors that are not :func:`chunkable`:
        the compressor's own exchange of every rank's chunks, then this rank keeps its own. Per-tensor
        compressors (PowerSGD) get each parameter's padded shard in each chunk as a matrix (a block of
        its rows); the flat chunks when some parameter had no gradient (FSDP then leaves it out)."""
        c, n, r = self.compressor, comm.world_size, comm.rank
        self._check_finite(flat)
        rows = flat.reshape(n, -1)
        per = len(shapes) if c.per_tensor and sum(s.numel() for s in shapes) == rows.shape[1] else 0
        tensors = [t for j in range(n) for t in unflatten(rows[j], shapes)] if per else list(rows)
        scheme = next(self._rs_schemes[i] for i, (_, cm) in enumerate(self._comms) if cm is comm)
        res = _run(scheme.exchange(c, tensors, f"{key}/all"))
        mine = torch.cat([t.reshape(-1) for t in res[r * per:(r + 1) * per]]) if per else res[r].reshape(-1)
        return mine.mul(mean_scale) if mean_scale != 1.0 else mine.clone()

    def _replica_hook(self, key: str, shapes: list[torch.Size]):
        def hook(reduce_output: Tensor) -> None:
            """Average this shard over the replicas, compressed (FSDP already averaged the shard group).
            Per-tensor compressors (PowerSGD) get each parameter's padded local shard as a matrix;
            the flat shard when some parameter had no gradient (FSDP then leaves it out)."""
            assert self._scheme is not None
            t0 = time.perf_counter()
            self._check_finite(reduce_output)
            tensors = [reduce_output]
            if self.compressor.per_tensor and sum(s.numel() for s in shapes) == reduce_output.numel():
                tensors = unflatten(reduce_output, shapes)
            with torch.no_grad():
                for t, out in zip(tensors, _run(self._scheme.exchange(self.compressor, tensors, f"{key}/replica"))):
                    if out.data_ptr() != t.data_ptr():
                        t.copy_(out)
            self.reduce_s += time.perf_counter() - t0
        return hook

    def _check_finite(self, t: Tensor) -> None:
        # One reduction, no mask: an inf or NaN anywhere makes the sum non-finite (as the engine checks).
        if not bool(torch.isfinite(t.sum(dtype=torch.float32))):
            self.nonfinite += 1

    # -- steps that may be undone ----------------------------------------------------------
    def begin_step(self) -> None:
        """Open a step whose compressor state updates (error memory, PowerSGD's Q, the twophase
        server's memory) :meth:`end_step` keeps or undoes, and reset :attr:`nonfinite`. A trainer
        that skips a step with an inf or NaN gradient on any rank calls ``end_step(keep=False)``
        on every rank; callers that never open a step get the updates as they happen."""
        self.nonfinite = 0
        self.compressor.begin_step()
        for server in self._servers():
            server.begin_step()

    def end_step(self, keep: bool) -> None:
        """Close the step :meth:`begin_step` opened: keep its state updates, or undo them."""
        self.compressor.end_step(keep)
        for server in self._servers():
            server.end_step(keep)

    def _servers(self) -> list[Compressor]:
        """The twophase schemes' server compressors (their memory is state too)."""
        schemes = [self._scheme, *self._rs_schemes.values()]
        return [st.server for st in schemes if st is not None and st.server is not None]

    # -- figures -----------------------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        return int(sum(comm.stats.bytes_sent for _, comm in self._comms))

    @property
    def stats(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for _, comm in self._comms:
            for op, t in comm.stats.by_op.items():
                row = out.setdefault(op, {"calls": 0, "bytes": 0})
                row["calls"] += t.calls
                row["bytes"] += t.bytes_sent
        return out

    # -- checkpoints ---------------------------------------------------------------------
    def _shape(self) -> list[int]:
        """The mesh this state belongs to: [shard group size, replica group size]."""
        if self._scheme is not None:
            return [self.shard_size, self._comms[0][1].world_size]
        return [self._comms[0][1].world_size if self._comms else 1, 1]

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (tensors and numbers only): save it per rank."""
        sd: dict[str, Any] = {"mesh": self._shape(), "compressor": self.compressor.state_dict()}
        if self._scheme is not None:
            sd["scheme"] = self._scheme.state_dict()
        if any(st.server is not None for st in self._rs_schemes.values()):
            sd["rs_schemes"] = {str(i): st.state_dict() for i, st in self._rs_schemes.items()}
        return sd

    def load_state_dict(self, state: dict[str, Any], reset_error: bool = False) -> None:
        """Resume from :meth:`state_dict` on the same mesh. ``reset_error=True``: start the
        compressor's state afresh (zero error memory) instead, which also allows another mesh."""
        got, want = [int(x) for x in state.get("mesh", [])], self._shape()
        if reset_error:  # a fresh compressor's state: no memory, counters at zero
            self.compressor.load_state_dict(_build(self._spec_in, self.ef_dtype).state_dict())
            return
        if got != want:
            raise GradzipError(f"fsdp_compress: state saved on a mesh of shape {got} (shard, replicate) cannot "
                               f"load on shape {want}; pass reset_error=True to start the error memory afresh")
        try:
            self.compressor.load_state_dict(state["compressor"])
            if self._scheme is not None:
                self._scheme.load_state_dict(state.get("scheme", {}))
            for i, st in self._rs_schemes.items():
                st.load_state_dict(state.get("rs_schemes", {}).get(str(i), {}))
        except (KeyError, ValueError, TypeError) as e:
            raise GradzipError(f"fsdp_compress: this state does not fit compressor {self.spec!r}: {e}") from None

    def remove(self) -> None:
        """FSDP's own reduce-scatter (1-D) or all-reduce hook (HSDP) again, through the same public
        setters, given what each module had at attach time; closes gradzip's communicators."""
        if self._removed:
            return
        self._removed = True
        for unit, was in zip(self.units, self._saved):
            if self._scheme is None:
                unit.module.set_custom_reduce_scatter(was.reduce_scatter)  # type: ignore[operator]
            else:
                unit.module.set_all_reduce_hook(was.all_reduce_hook)  # type: ignore[operator]
        for _, comm in self._comms:
            comm.close()


def _build(spec: str, ef_dtype: torch.dtype | None) -> Compressor:
    if not isinstance(spec, str):
        raise GradzipError(f"fsdp_compress: spec must be a compressor spec string, got {type(spec).__name__}")
    try:
        comp = create(spec)
    except SpecError as e:
        raise GradzipError(f"fsdp_compress: {e}") from None
    if ef_dtype is not None and ef_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise GradzipError(f"fsdp_compress: ef_dtype must be torch.float32, torch.bfloat16 or torch.float16, "
                           f"got {ef_dtype}")
    if ef_dtype not in (None, torch.float32):
        if not isinstance(comp, ErrorFeedback):
            raise GradzipError(f"fsdp_compress: ef_dtype={ef_dtype} sets the error memory's dtype, but {comp.spec!r} "
                               "keeps no error memory; add ef=true to the spec or drop ef_dtype")
        if comp.per_tensor:
            raise GradzipError(f"fsdp_compress: ef_dtype={ef_dtype} is not supported with {comp.name}, whose "
                               "memory is kept per matrix; drop ef_dtype")
        comp = ErrorFeedback(comp.inner, memory_dtype=ef_dtype)
    return comp


def _run(ex: Any) -> list[Tensor]:
    """Run an exchange to its end on this rank (each round waits for the others)."""
    ex.start()
    while not ex.advance():
        pass
    return ex.result()


def _fsdp_units(model: nn.Module) -> list[FSDPUnit]:
    """The FSDP modules of ``model`` that manage parameters (:func:`gradzip.engine.fsdp_compat.fsdp_units`)."""
    if not isinstance(model, nn.Module):
        raise GradzipError(f"fsdp_compress: model must be an nn.Module, got {type(model).__name__}")
    units = fsdp_units(model)
    if not any(is_fsdp_module(m) for m in model.modules()):
        raise GradzipError("fsdp_compress: the model has no FSDP module; call "
                           "torch.distributed.fsdp.fully_shard on it (and its submodules) first")
    return units


def _check_replicas(units: list[FSDPUnit], rgroup: Any) -> None:
    """HSDP: a shard group and the replica group share this rank alone (else the gradient would be
    averaged twice over the same ranks)."""
    me, replicas = dist.get_rank(), set(dist.get_process_group_ranks(rgroup))
    for unit in units:
        shard = set(dist.get_process_group_ranks(unit.shard_group))
        if shard & replicas != {me}:
            raise GradzipError(f"fsdp_compress: module {unit.key!r} is sharded over global ranks {sorted(shard)}, "
                               f"which overlap the replica group {sorted(replicas)}; shard over the intra-node mesh "
                               "(fully_shard(mesh=mesh['shard'])) and replicate over the other dimension")


def _replica_group(replicate: Any) -> Any:
    if replicate is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(replicate, DeviceMesh):
        if replicate.ndim != 1:
            raise GradzipError(f"fsdp_compress: replicate must be a 1-D DeviceMesh, got {replicate.ndim}-D")
        return replicate.get_group()
    if isinstance(replicate, dist.ProcessGroup):
        return replicate
    raise GradzipError(f"fsdp_compress: replicate must be a ProcessGroup or a 1-D DeviceMesh, "
                       f"got {type(replicate).__name__}")


def fsdp_compress(model: nn.Module, spec: str, *, replicate: Any = None, ef_dtype: torch.dtype | None = None,
                  timeout: float = 300.0, agree: dict[str, Any] | None = None) -> FSDPCompression:
    """Compress the gradient reduction of a ``fully_shard``-ed ``model`` with ``spec`` (see the module
    docstring). Collective: call it on every rank, after ``fully_shard`` and before the first backward.
    ``replicate``: the replica group for HSDP (None: 1-D FSDP). ``ef_dtype``: the dtype of the error
    memory (``torch.bfloat16`` halves it). ``timeout``: seconds every collective may take. ``agree``:
    further settings (JSON-able) that every rank must share, compared with the spec at attach time."""
    return FSDPCompression(model, spec, replicate, ef_dtype, timeout, agree)
