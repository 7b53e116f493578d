"""DDP adapter: every gradzip compressor as a ``DistributedDataParallel`` communication hook.

Example (every rank, before training)::

    ddp = DistributedDataParallel(model)
    state, hook = gradzip.ddp_hook("topk:ratio=0.01,ef=true")
    ddp.register_comm_hook(state, hook)

The state may be built before the process group exists (Lightning's ``DDPStrategy(ddp_comm_state=
state, ddp_comm_hook=hook)`` is built that early): it binds to the default group at the hook's
first call, and the check that every rank passed the same spec and options runs then.

What the hook does with each of DDP's buckets (``GradBucket``), in the order DDP calls it:

1. Split the bucket's gradients by the engine's policy: tensors with at least
   ``min_compress_numel`` elements are compressed, smaller ones (biases, LayerNorm) are sent
   uncompressed with ``none``.
2. Compress and *launch* the exchange on the calling (autograd) thread: element-wise compressors
   get the compressed tensors as one flat tensor, PowerSGD gets them per matrix. Its collectives run
   in the background while backward continues.
3. On the last bucket of the step (``bucket.is_last()``), finish every exchange of the step in
   waves (PowerSGD's second round, decoding), write the averages into the buckets' buffers and
   complete the futures DDP waits on.

All collectives are issued on DDP's autograd thread in bucket order, never from a helper thread,
so they stay in the same order on every rank even next to DDP's own collectives
(``find_unused_parameters``' allreduce, buffer broadcasts).

Compressor state (error memory, PowerSGD's Q) is keyed by ``bucket<index>`` and the bucket's
parameter layout. DDP rebuilds its buckets after the first iteration (unless
``find_unused_parameters=True``), in the order gradients became ready: a bucket with a new layout
takes over the error memory of its parameters, element for element, from the keys that held them,
and a key whose parameters have all moved is freed. What cannot follow a new layout restarts:
PowerSGD's warm-start Q (one fresh power-iteration step, as torch's ``powerSGD_hook`` compresses
only from iteration 2 on) and ``twophase``'s server memory (a shard of the old chunking).
Communication goes through a :class:`gradzip.comm.torch_backend.TorchCommunicator` on the default
process group, so bytes and times are in ``state.comm.stats``.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as live objects.
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradzip.comm.torch_backend import TorchCommunicator
from gradzip.compress.base import Compressor, unflatten
from gradzip.compress.none import NoCompression
from gradzip.compress.registry import create
from gradzip.engine.exchange import Exchange
from gradzip.engine.handshake import check_agreement, fingerprint
from gradzip.engine.schemes import SchemeState
from gradzip.errors import GradzipError

_Part = tuple[Any, list[int], bool]  # exchange, indices of the bucket's gradients, flat result


class GradzipHookState:
    """The state passed to :func:`gradzip_comm_hook`: compressor, communicator, pending exchanges.

    ``comm=None``: bind late, at the first hook call (:meth:`bind`), to the default process group.
    ``stats()`` gives this rank's figures since its last call (bytes per step, compression ratio,
    compression time) for a trainer's logs."""

    def __init__(self, compressor: str | Compressor, comm: Any = None, min_compress_numel: int = 1024,
                 timeout: float | None = None) -> None:
        if min_compress_numel < 0:
            raise GradzipError(f"min_compress_numel must be >= 0, got {min_compress_numel}")
        self.compressor = create(compressor)
        self.spec = self.compressor.spec
        self.timeout = timeout
        self.comm: Any = None
        self.scheme: SchemeState | None = None  # e.g. twophase's server memory; built at bind
        self._scheme_state: dict[str, Any] = {}  # loaded before binding: applied at bind
        self.min_compress_numel = min_compress_numel
        self._plain = NoCompression()
        self._split = not self.compressor.identity
        self._per_tensor = self.compressor.per_tensor
        self._pending: list[tuple[Tensor, list[Tensor], list[_Part], torch.futures.Future]] = []
        self._ordinal: dict[int, int] = {}  # id(parameter) -> order of first appearance (same on all ranks)
        self._layouts: dict[int, list[tuple[int, ...]]] = {}  # bucket index -> parameter layouts seen
        # Keys with compressed state: key -> (ordinals, numels) of its compressed parameters, in
        # order; and which key holds each parameter's error memory now.
        self._members: dict[str, tuple[list[int], list[int]]] = {}
        self._owner: dict[int, str] = {}
        self._totals = {"steps": 0, "bytes": 0, "plain_bytes": 0.0, "compress_s": 0.0}  # since stats()
        self._bytes_mark = 0
        if comm is not None:
            self._attach(comm)

    def bind(self) -> None:
        """Bind to the default process group (once): build the communicator, check that every rank
        has the same spec and options (one line on every rank otherwise), build the scheme."""
        if self.comm is not None:
            return
        if not dist.is_available() or not dist.is_initialized():
            raise GradzipError("ddp_hook: torch.distributed is not initialised at the hook's first call; "
                               "DDP needs dist.init_process_group first")
        comm = TorchCommunicator() if self.timeout is None else TorchCommunicator(timeout=self.timeout)
        try:
            check_agreement([comm], [fingerprint([], self.spec, {"min_compress_numel": self.min_compress_numel})])
        except BaseException:
            comm.close()
            raise
        self._attach(comm)

    def _attach(self, comm: Any) -> None:
        self.comm = comm
        self.scheme = SchemeState(self.compressor, comm)
        self.scheme.load_state_dict(self._scheme_state)
        self._bytes_mark = comm.stats.bytes_sent

    def stats(self, reset: bool = True) -> dict[str, float]:
        """This rank's figures over the steps since the last ``stats()``: ``steps`` exchanged,
        ``bytes_per_step`` sent, ``compression_ratio`` (what an fp32 ring allreduce of the same
        gradients would send, over what was sent), ``compress_s_per_step`` (encode and decode).
        Empty before any step."""
        t = dict(self._totals)
        sent = (self.comm.stats.bytes_sent - self._bytes_mark) if self.comm is not None else 0
        if reset:
            self._totals = {"steps": 0, "bytes": 0, "plain_bytes": 0.0, "compress_s": 0.0}
            self._bytes_mark += sent
        if not t["steps"]:
            return {}
        n = t["steps"]
        return {"steps": n, "bytes_per_step": sent / n, "compress_s_per_step": t["compress_s"] / n,
                "compression_ratio": t["plain_bytes"] / sent if sent else float("nan")}

    def layout(self, bucket: dist.GradBucket) -> tuple[int, ...]:
        """The bucket's parameters as ordinals (order of first appearance: the same on every rank
        and in every process of a run, since DDP's first layout is always the same)."""
        return tuple(self._ordinal.setdefault(id(p), len(self._ordinal)) for p in bucket.parameters())

    def key(self, bucket: dist.GradBucket) -> str:
        """State key of a bucket: ``bucket<index>`` for its first layout; a later layout under the
        same index (DDP's rebuild) gets ``bucket<index>~<digest of the layout>``, so that no state
        is applied to the wrong parameters (its error memory moves over in :meth:`start`)."""
        layout = self.layout(bucket)
        seen = self._layouts.setdefault(bucket.index(), [])
        if layout not in seen:
            seen.append(layout)
        if seen.index(layout) == 0:
            return f"bucket{bucket.index()}"
        return f"bucket{bucket.index()}~{zlib.crc32(repr(layout).encode()):08x}"

    # -- called by the hook ------------------------------------------------------------
    def start(self, key: str, buffer: Tensor, grads: list[Tensor],
              layout: tuple[int, ...] | None = None) -> list[_Part]:
        """Compress and launch one bucket's exchanges (compressed part first, then plain).
        ``layout``: the gradients' parameter ordinals, for carrying error memory across layouts."""
        big = [i for i, g in enumerate(grads) if not self._split or g.numel() >= self.min_compress_numel]
        chosen = set(big)
        small = [i for i, g in enumerate(grads) if i not in chosen and g.numel() > 0]
        parts: list[_Part] = []
        if big:
            if self._per_tensor:
                tensors, flat = [grads[i] for i in big], False
            elif len(big) == len(grads):
                tensors, flat = [buffer], True  # the whole bucket: no copy
            else:
                tensors, flat = [torch.cat([grads[i].reshape(-1) for i in big])], True
            if layout is not None:
                self._carry(key, [layout[i] for i in big], [grads[i].numel() for i in big], [t.shape for t in tensors])
            parts.append((self.scheme.exchange(self.compressor, tensors, key), big, flat))
        if small:
            tensors = [torch.cat([grads[i].reshape(-1) for i in small])]
            parts.append((Exchange(self._plain, self.comm, tensors, key=f"{key}/plain"), small, True))
        for ex, _, _ in parts:
            ex.start()
        n = self.comm.world_size
        self._totals["plain_bytes"] += 4 * sum(g.numel() for g in grads) * 2 * (n - 1) / n  # fp32 ring allreduce
        return parts

    @torch.no_grad()
    def _carry(self, key: str, ords: list[int], numels: list[int], shapes: list[torch.Size]) -> None:
        """First use of ``key``: take over its parameters' error memory from the keys that held
        them (a rebuilt bucket), and free each old key once all of its parameters have moved."""
        if key in self._members:
            return
        self._members[key] = (ords, numels)
        pieces: dict[int, Tensor] = {}
        for old in dict.fromkeys(self._owner[o] for o in ords if o in self._owner):
            old_ords, old_numels = self._members[old]
            res = self.scheme.residual(old, sum(old_numels))
            if res is not None:
                pieces.update((o, p) for o, p in zip(old_ords, torch.split(res, old_numels)) if o in set(ords))
        for o in ords:
            self._owner[o] = key
        for old in [k for k in self._members if k != key and not any(self._owner.get(o) == k
                                                                    for o in self._members[k][0])]:
            self.scheme.forget(old)  # every parameter has moved on: free its memory
            del self._members[old]
        if pieces:
            like = next(iter(pieces.values()))
            flat = torch.cat([pieces[o] if o in pieces else like.new_zeros(n) for o, n in zip(ords, numels)])
            self.scheme.set_residual(key, flat, shapes)

    @torch.no_grad()
    def drain(self) -> None:
        """Finish every pending exchange (waves in bucket order), write back, complete futures."""
        pending, self._pending = self._pending, []
        try:
            exchanges = [ex for _, _, parts, _ in pending for ex, _, _ in parts]
            active = exchanges
            while active:
                active = [ex for ex in active if not ex.advance()]
            self._totals["steps"] += 1
            self._totals["compress_s"] += sum(ex.compress_s for ex in exchanges)
            for buffer, grads, parts, fut in pending:
                for ex, idx, flat in parts:
                    res = ex.result()
                    outs = unflatten(res[0], [grads[i].shape for i in idx]) if flat else res
                    for i, o in zip(idx, outs):
                        if o.data_ptr() != grads[i].data_ptr():
                            grads[i].copy_(o)
                fut.set_result(buffer)
        except BaseException as e:
            for _, _, _, fut in pending:
                if not fut.done():
                    fut.set_exception(e)
            raise

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state (error memory, Q, the layouts it belongs to): save it per rank."""
        scheme = self.scheme.state_dict() if self.scheme is not None else self._scheme_state
        return {"spec": self.spec, "compressor": self.compressor.state_dict(), "scheme": scheme,
                "members": {k: [list(o), list(n)] for k, (o, n) in self._members.items()},
                "owner": {str(o): k for o, k in self._owner.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("spec") != self.spec:
            raise GradzipError(f"hook state is for compressor {state.get('spec')!r}, not {self.spec!r}")
        self.compressor.load_state_dict(state["compressor"])
        self._scheme_state = state.get("scheme", {})
        if self.scheme is not None:
            self.scheme.load_state_dict(self._scheme_state)
        members = state.get("members", {})
        self._members = {k: ([int(x) for x in o], [int(x) for x in n]) for k, (o, n) in members.items()}
        self._owner = {int(o): k for o, k in state.get("owner", {}).items()}

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()


def gradzip_comm_hook(state: GradzipHookState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook; see the module docstring."""
    state.bind()
    buffer = bucket.buffer()
    # Views into the flat buffer, one per parameter; results are written through them.
    grads = unflatten(buffer, [g.shape for g in bucket.gradients()])
    try:
        parts = state.start(state.key(bucket), buffer, grads, state.layout(bucket))
    except BaseException:
        state._pending.clear()
        raise
    fut: torch.futures.Future[Tensor] = torch.futures.Future()
    state._pending.append((buffer, grads, parts, fut))
    if bucket.is_last():
        state.drain()
    return fut

