"""``torch``: torch.distributed process groups — Gloo on CPU, NCCL on CUDA.

Create it through :func:`gradzip.comm.init_communicator` (which reads the launcher's environment),
or directly::

    comm = TorchCommunicator("gloo", rank=r, world_size=n, master_addr="10.0.0.1", master_port=29500)
    comm = TorchCommunicator()          # over a default process group that already exists (DDP code)
    comm = TorchCommunicator.adopt(pg)  # over any existing group (FSDP's, a DeviceMesh dimension's)

How each collective maps onto torch.distributed (all ``async_op=True``; ``wait()`` enforces
``self.timeout``):

- allreduce: ``all_reduce(SUM)`` in place, then ``/ world_size`` for ``mean``. Gloo (torch 2.13)
  reduces fp32/fp64/fp16/bf16/int*/uint8 natively, so nothing is upcast: fp16/bf16 are summed in
  their own precision at every ring step (as NCCL does), which can differ from ``sim``'s fp32
  accumulation by a rounding of the payload dtype. Non-contiguous tensors go through a copy.
- allgather with ``same_shape=True``: one ``all_gather_single`` (``all_gather_into_tensor`` before
  torch 2.13) of the payload's bytes (a ``uint8`` view: any dtype) into an ``(n, numel)`` buffer,
  launched async at once; no header. Results are views of its rows. No elements, or a world of
  one: copied locally.
- allgather of per-rank shapes: (1) a small fixed-size allgather of a header (collective number,
  dtype, shape) on the separate Gloo side group (never queued behind large data ops), launched
  async. It also checks that all ranks are at the same collective with the same dtype. (2)
  ``all_gather`` of the flattened payloads' bytes (any dtype) padded to the largest, launched async
  once the header is back: deferred in the process-wide FIFO of :mod:`gradzip.comm._common`
  (launched at the next issue that finds the header back, before any later data-group launch, or
  before any wait blocks), so data collectives are launched in issue order and the launch never
  blocks. ``wait()`` trims and reshapes (results are views of one buffer). A CUDA payload's data
  launch runs on the stream that was current at issue.
- broadcast: ``broadcast`` in place. barrier: a Gloo barrier on the side group.
- alltoall: ``all_to_all_single`` of the tensor's bytes (a ``uint8`` view, so every dtype works,
  bool and complex included; Gloo on CPU supports it in torch 2.13) into a new tensor. Shape and
  dtype are not exchanged: every rank must pass the same (the contract). A tensor without
  elements, or a world of one, is copied locally.
- split: an int64 allgather of ``(collective number, colour, key)`` on the side group, then one
  data group and one Gloo side group per colour (:func:`~gradzip.comm._torch_groups.split_groups`:
  torch's ``new_group`` where every process of the job is a member, else groups that only the
  members create, or NCCL's ``split_group``). torch orders a group's ranks by global rank; where
  the ``(key, rank)`` order differs, allgather results, broadcast roots and alltoall chunks are
  mapped between the two orders (zero-copy: alltoall then uses ``all_to_all`` on chunk views). A
  sub-communicator records into its parent's ``stats``, has its own heartbeat and collective
  numbering, and is closed (idempotent) by its parent's ``close()``; closing it destroys only its
  own two groups.
- control: a sub-communicator of the same members made the same way (no collective of the parent,
  so its numbering is untouched), whose Gloo/NCCL groups have their own queues and connections;
  it follows its parent's timeout, and its errors name the parent's rank ("rank 1, control channel").

Bytes are accounted with :mod:`gradzip.comm.cost` (padding and headers are not counted, as in ``sim``;
a split counts as ``sim`` counts it: op ``"split"``, an allgather of 16 bytes per rank); seconds are
measured launch → end of ``wait()``.

Failure detection. Every rank runs a heartbeat thread (:mod:`gradzip.comm._heartbeat`) that writes
``beat, collectives launched, state`` into the rendezvous store every 0.25 s. When a collective
fails (Gloo reports a closed connection at once when a peer dies; NCCL only by timeout) or times
out, the rank watches the heartbeats for ``diagnose_s`` (2 s) and names, in the
:class:`~gradzip.errors.CommError`, the ranks whose heartbeat stopped (lost), the ones that reported
an error themselves, and live ranks that have not launched the collective yet. So the error arrives
at most ``timeout + diagnose_s`` after ``wait()`` began. If the store itself is gone, its host
(rank 0, unless torchrun's agent hosts it) is named as lost. A sub-communicator's errors name
**global** ranks ("lost global rank(s) [3]", "on global rank 1 (rank 0 of the sub-communicator
of global ranks [1, 3])"); the top-level communicator's ranks are the global ones.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradzip.comm import cost
from gradzip.comm._common import (
    HEADER_LEN,
    RealCommunicator,
    TimedHandle,
    as_contiguous,
    decode_headers,
    defer_launch,
    describe,
    encode_header,
    flush_launches,
    mean_inplace,
    progress_launches,
    raise_mismatch,
)
from gradzip.comm._heartbeat import Heartbeat
from gradzip.comm._torch_groups import init_process_group, is_timeout, member_group, split_groups
from gradzip.comm.base import DEFAULT_TIMEOUT_S, Handle, ReduceOp, check_alltoall, nbytes, split_order
from gradzip.errors import CommError, CommTimeout, GradzipError


class TorchCommunicator(RealCommunicator):
    """torch.distributed endpoint; see the module docstring."""

    backend = "torch"
    _instances = 0  # per process; keys the heartbeats of several communicators apart

    def __init__(self, backend: str | None = None, rank: int | None = None, world_size: int | None = None, *,
                 master_addr: str | None = None, master_port: int | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, device: torch.device | None = None,
                 heartbeat_s: float = 0.25, diagnose_s: float = 2.0) -> None:
        self._blank()
        self._owns_pg = not dist.is_initialized()
        if self._owns_pg:
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            rank = int(os.environ["RANK"]) if rank is None and "RANK" in os.environ else rank
            world_size = int(os.environ["WORLD_SIZE"]) if world_size is None and "WORLD_SIZE" in os.environ \
                else world_size
            if rank is None or world_size is None:
                raise GradzipError("torch backend: rank and world size unknown: start under torchrun/mpirun/srun, "
                                   "use `gradzip train --workers N`, or pass rank= and world_size=")
            init_process_group(backend, rank, world_size, master_addr, master_port, timeout, device)
        # A Gloo side group for size headers and barriers: never queued behind large data ops.
        side = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        TorchCommunicator._instances += 1
        self._start(dist.group.WORLD, side, list(range(dist.get_world_size())), None,
                    str(TorchCommunicator._instances), timeout, device, heartbeat_s, diagnose_s)
        atexit.register(self.close)  # also on an uncaught CommError: see close()

    @classmethod
    def adopt(cls, group: Any, *, timeout: float = DEFAULT_TIMEOUT_S, heartbeat_s: float = 0.25,
              diagnose_s: float = 2.0) -> TorchCommunicator:
        """A communicator over an existing torch process group (a DeviceMesh dimension's, FSDP's),
        which it neither owns nor destroys. Collective over the group's members, which must adopt
        their groups in the same order; ranks are the group's and errors name global ranks."""
        if not dist.is_initialized():
            raise GradzipError("TorchCommunicator.adopt: torch.distributed is not initialised")
        members = [int(g) for g in dist.get_process_group_ranks(group)]
        count = cls._adopted.get(tuple(members), 0)  # the same on every member: names the side group
        cls._adopted[tuple(members)] = count + 1
        side = member_group(members, "gloo", f"gradzip/adopt/{'-'.join(map(str, members))}/{count}",
                            timedelta(seconds=timeout))
        self = cls.__new__(cls)
        self._blank()
        self._named_global = True
        TorchCommunicator._instances += 1
        self._start(group, side, members, None, f"adopt{'-'.join(map(str, members))}.{count}", timeout, None,
                    heartbeat_s, diagnose_s)
        atexit.register(self.close)
        return self

    _adopted: dict[tuple[int, ...], int] = {}  # per process: adopted groups by member ranks

    def _blank(self) -> None:
        """The fields that close() and the timeout setter read, before any group exists."""
        self._owns_pg = False  # this communicator initialised the default group (top level only)
        self._broken = False  # a collective of this communicator failed
        self._tree_broken = False  # (on the top-level one) a collective of it or of a descendant failed
        self._closed = False
        self._hb: Heartbeat | None = None
        self._side = None
        self._parent: TorchCommunicator | None = None
        self._root: TorchCommunicator = self
        self._children: list[TorchCommunicator] = []
        self._splits = 0
        self._named_global = False  # errors name global ranks (sub-communicators, adopted groups)
        self._control: TorchCommunicator | None = None  # control(), once made
        self._control_of: TorchCommunicator | None = None  # on a control channel: its communicator

    def _start(self, group, side, members: list[int], perm: list[int] | None, instance: str, timeout: float,
               device: torch.device | None, heartbeat_s: float, diagnose_s: float) -> None:
        """Adopt ``group``/``side`` (every member calls this): ``members[r]`` is the global rank of
        this communicator's rank ``r``; ``perm[r]`` its rank in torch's group (None: the same)."""
        self.group, self._side, self._members, self._perm = group, side, members, perm
        self.dist_backend = dist.get_backend(group)
        super().__init__(members.index(dist.get_rank()), len(members), timeout)
        self.device = device or (torch.device("cuda", torch.cuda.current_device())
                                 if self.dist_backend == "nccl" else torch.device("cpu"))
        self.diagnose_s, self._heartbeat_s = diagnose_s, heartbeat_s
        self._seq = 0
        self._instance = instance
        store = dist.distributed_c10d._get_default_store()
        try:
            store = store.clone()  # its own connection: the heartbeat thread never contends with c10d
        except Exception:
            pass
        host = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0
        self._hb = Heartbeat(store, self.rank, self.world_size, lambda: self._seq, heartbeat_s, host, instance,
                             members if self._parent is not None or self._named_global else None)
        self._wait_work(dist.barrier(group=side, async_op=True), -1, "init barrier")

    # -- timeout also bounds the ops inside Gloo/NCCL -----------------------------------
    @property
    def timeout(self) -> float:
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout = float(value)
        # Our own groups only: a process group adopted from the user (DDP) keeps its timeout.
        own = getattr(self, "_owns_pg", False) or getattr(self, "_parent", None) is not None
        for g in (getattr(self, "group", None) if own else None, getattr(self, "_side", None)):
            if g is not None:
                # torch 2.14 has the public setter; 2.13 only the private one it replaced
                setter = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
                try:
                    setter(timedelta(seconds=self._timeout), g)
                except Exception:  # our own wait() timeout still applies
                    pass
        if getattr(self, "_control", None) is not None:  # the control channel follows this one's timeout
            self._control.timeout = self._timeout

    # -- helpers ------------------------------------------------------------------------
    def _where(self) -> str:
        """This rank, for messages: sub-communicators name the global rank first."""
        if self._control_of is not None:
            return f"{self._control_of._where()}, control channel"
        if self._parent is None and not self._named_global:
            return f"rank {self.rank}"
        what = "sub-communicator" if self._parent is not None else "process group"
        return (f"global rank {self._members[self.rank]} (rank {self.rank} of the {what} of global ranks "
                f"{self._members})")

    def _fail(self, desc: str, seq: int, err: BaseException, timed_out: bool) -> None:
        self._broken = self._root._tree_broken = True
        if self._hb is not None:
            self._hb.set_state(f"error:{desc}")
            diag = self._hb.diagnose(seq, self.diagnose_s)
        else:
            diag = "no heartbeat available"
        what = f"timed out after {self.timeout:g} s" if timed_out else "failed"
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        detail = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", detail).split(". This is")[0]  # Gloo's source path
        # The backend's own words add nothing to "timed out" (they stay in the chained exception).
        said = "" if timed_out and is_timeout(RuntimeError(detail)) else f" [{self.dist_backend}: {detail}]"
        cls = CommTimeout if timed_out else CommError
        raise cls(f"{desc} {what} on {self._where()}: {diag}{said}") from err

    def _launch(self, desc: str, seq: int, fn: Callable[[], dist.Work], flush: bool = True) -> dist.Work:
        """Launch ``fn`` (a collective); ``flush``: first launch every deferred allgather data
        collective, so that the groups see the collectives in issue order."""
        if flush:
            flush_launches()
        try:
            return fn()
        except dist.DistError as e:  # communication failures; bad arguments (ValueError etc.) pass through
            self._fail(desc, seq, e, is_timeout(e))
            raise  # unreachable: _fail raises

    def _wait_work(self, work, seq: int, desc: str, flush: bool = True) -> None:
        """Wait for ``work`` up to the timeout; ``flush``: first launch every deferred data collective
        (a rank never blocks with one unlaunched; header waits need not)."""
        if flush:
            flush_launches()
        try:
            ok = work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as e:
            self._fail(desc, seq, e, is_timeout(e))
        else:
            if ok is False:
                self._fail(desc, seq, TimeoutError("work.wait returned False"), True)

    def _check(self, t: Tensor) -> None:
        if self.dist_backend == "nccl" and not t.is_cuda:
            raise ValueError(f"NCCL communicator needs CUDA tensors, got one on {t.device}")

    def _groups(self, colours: list[int], keys: list[int], colour: int, instance: str, every: bool) -> tuple:
        return split_groups(self.group, self.dist_backend, self._members, self._perm, self.device, every,
                            colours, keys, colour, instance, timedelta(seconds=self.timeout))

    def _gather_rows(self, desc: str, seq: int, row: Tensor) -> Tensor:
        """Blocking int64 allgather of one row per rank on the side group, in this communicator's
        rank order (the split's colours)."""
        rows = torch.empty(self.world_size, row.numel(), dtype=torch.int64)
        w = self._launch(desc, seq, lambda: dist.all_gather(list(rows.unbind(0)), row, self._side, async_op=True))
        self._wait_work(w, seq, desc)
        return rows if self._perm is None else rows[self._perm]

    # -- the contract -------------------------------------------------------------------
    def allreduce_async(self, tensor: Tensor, op: ReduceOp = "sum") -> Handle:
        self._check_op(op)
        self._check(tensor)
        t0 = time.perf_counter()
        seq = self._next()
        desc = describe("allreduce", seq, tensor, op)
        buf, write_back = as_contiguous(tensor)
        work = self._launch(desc, seq, lambda: dist.all_reduce(buf, dist.ReduceOp.SUM, self.group, async_op=True))

        def finish() -> Tensor:
            self._wait_work(work, seq, desc)
            if write_back is not None:
                write_back()
            if op == "mean":
                mean_inplace(tensor, self.world_size)
            return tensor

        s = cost.allreduce_bytes(nbytes(tensor), self.world_size)
        return TimedHandle(self, "allreduce", s, s, finish, t0, work.is_completed)

    def _allgather_same(self, tensor: Tensor, seq: int, desc: str, t0: float) -> Handle:
        n, shape = self.world_size, tensor.shape
        sent, recv = cost.allgather_bytes([nbytes(tensor)] * n, self.rank)
        out = torch.empty((n, tensor.numel()), dtype=tensor.dtype, device=tensor.device)  # torch's rank order
        if n == 1 or tensor.numel() == 0:  # nothing to exchange: every rank knows every shape
            out[0].copy_(tensor.reshape(-1))
            return TimedHandle(self, "allgather", sent, recv, lambda: [r.view(shape) for r in out], t0, lambda: True)
        send = tensor.reshape(-1).contiguous().view(torch.uint8)  # raw bytes: every dtype travels
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = self._launch(desc, seq, lambda: gather(out.view(-1).view(torch.uint8), send, self.group, async_op=True))
        row = self._perm or list(range(n))

        def finish() -> list[Tensor]:
            self._wait_work(work, seq, desc)
            return [out[row[r]].view(shape) for r in range(n)]

        return TimedHandle(self, "allgather", sent, recv, finish, t0, work.is_completed)

    def _allgather_var(self, tensor: Tensor, seq: int, desc: str, t0: float) -> Handle:
        n, hdesc = self.world_size, desc + " size exchange"
        progress_launches()
        rows, header = torch.empty(n, HEADER_LEN, dtype=torch.int64), encode_header(tensor, seq)
        hwork = self._launch(hdesc, seq, lambda: dist.all_gather(list(rows.unbind(0)), header, self._side,
                                                                 async_op=True), flush=False)
        stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None
        got: dict[str, Any] = {}  # "work" (the data collective), "result" (() -> the results)

        def launch() -> None:  # from the FIFO, in issue order
            self._wait_work(hwork, seq, hdesc, flush=False)
            dtype, shapes = decode_headers(rows if self._perm is None else rows[self._perm], desc, self.rank,
                                           None if self._parent is None else self._members)
            numels = [math.prod(s) for s in shapes]
            handle.account(*cost.allgather_bytes([k * tensor.element_size() for k in numels], self.rank))
            m, row = max(numels), self._perm or list(range(n))
            if m == 0:
                got["result"] = lambda: [torch.empty(s, dtype=dtype, device=tensor.device) for s in shapes]
                return
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                flat = tensor.reshape(-1)
                padded = flat.contiguous() if flat.numel() == m else torch.cat([flat, flat.new_empty(m - flat.numel())])
                out = torch.empty((n, m), dtype=dtype, device=tensor.device)  # rows in torch's group order
                rows_b, padded_b = list(out.view(torch.uint8).unbind(0)), padded.view(torch.uint8)  # any dtype
                got["work"] = self._launch(desc, seq, lambda: dist.all_gather(rows_b, padded_b, self.group,
                                                                              async_op=True), flush=False)
            got["result"] = lambda: [out[row[r], :numels[r]].view(shapes[r]) for r in range(n)]

        def finish() -> list[Tensor]:
            flush_launches()
            if item.error is not None:
                raise item.error
            if "work" in got:
                self._wait_work(got["work"], seq, desc)
            return got["result"]()

        def poll() -> bool:
            progress_launches()
            return item.done and (item.error is not None or "work" not in got or got["work"].is_completed())

        handle = TimedHandle(self, "allgather", 0, 0, finish, t0, poll)
        item = defer_launch(launch, hwork.is_completed, self)
        return handle

    def broadcast_async(self, tensor: Tensor, src: int = 0) -> Handle:
        self._check_src(src)
        self._check(tensor)
        t0 = time.perf_counter()
        seq = self._next()
        desc = describe("broadcast", seq, tensor, f"from rank {src}")
        buf, write_back = as_contiguous(tensor)
        root = self._members[src]  # torch.distributed takes the root's global rank
        work = self._launch(desc, seq, lambda: dist.broadcast(buf, root, self.group, async_op=True))

        def finish() -> Tensor:
            self._wait_work(work, seq, desc)
            if write_back is not None:
                write_back()
            return tensor

        sent, recv = cost.broadcast_bytes(nbytes(tensor), self.world_size, self.rank, src)
        return TimedHandle(self, "broadcast", sent, recv, finish, t0, work.is_completed)

    def alltoall_async(self, tensor: Tensor) -> Handle:
        check_alltoall(tensor, self.world_size)
        self._check(tensor)
        t0 = time.perf_counter()
        seq = self._next()
        desc = describe("alltoall", seq, tensor)
        n = self.world_size
        s = cost.alltoall_bytes(nbytes(tensor), n)
        src = tensor.contiguous()
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        if n == 1 or tensor.numel() == 0:  # nothing to exchange
            out.copy_(src)
            return TimedHandle(self, "alltoall", s, s, lambda: out, t0, lambda: True)
        # Raw bytes: every dtype travels, whichever dtypes the library itself handles.
        send, recv = src.view(-1).view(torch.uint8), out.view(-1).view(torch.uint8)
        if self._perm is None:
            work = self._launch(desc, seq, lambda: dist.all_to_all_single(recv, send, group=self.group,
                                                                          async_op=True))
        else:  # torch's rank g is our rank c with perm[c] == g: hand it the chunk views in its order
            step = send.numel() // n
            ins, outs = send.split(step), recv.split(step)
            mine = sorted(range(n), key=lambda c: self._perm[c])  # ours, by torch's rank
            work = self._launch(desc, seq, lambda: dist.all_to_all([outs[c] for c in mine], [ins[c] for c in mine],
                                                                   group=self.group, async_op=True))

        def finish() -> Tensor:
            self._wait_work(work, seq, desc)
            return out

        return TimedHandle(self, "alltoall", s, s, finish, t0, work.is_completed)

    def barrier(self) -> None:
        t0 = time.perf_counter()
        seq = self._next()
        work = self._launch(f"barrier #{seq}", seq, lambda: dist.barrier(group=self._side, async_op=True))
        self._wait_work(work, seq, f"barrier #{seq}")
        self.stats.record("barrier", 0, 0, time.perf_counter() - t0)

    def split(self, colour: int, key: int | None = None) -> TorchCommunicator:
        """Collective: the ranks that pass the same ``colour`` form a new communicator (the same
        class, the same ``stats`` and timeout), ranked by ``(key, rank)``; ``key`` defaults to
        this rank. Sub-communicators of one parent must be created in the same order everywhere."""
        colour, key = int(colour), self.rank if key is None else int(key)
        t0 = time.perf_counter()
        seq = self._next()
        desc = f"split #{seq} (colour {colour}, key {key})"
        rows = self._gather_rows(desc, seq, torch.tensor([seq, colour, key], dtype=torch.int64)).tolist()
        if len({r[0] for r in rows}) != 1:
            raise_mismatch(desc, self.rank, "collective numbers", [r[0] for r in rows])
        colours, keys = [r[1] for r in rows], [r[2] for r in rows]
        # The same on every member (parent's key, its split count, colour): names heartbeats and groups.
        instance = f"{self._instance}.{self._splits}.{colour}"
        self._splits += 1
        try:
            group, side = self._groups(colours, keys, colour, instance, self._parent is None)
        except RuntimeError as e:  # DistError and Gloo's connect errors; bad arguments pass through
            self._fail(desc, seq, e, is_timeout(e))
        members = [self._members[i] for i in split_order(colours, keys, colour)]
        torch_order = dist.get_process_group_ranks(group)
        perm = [torch_order.index(g) for g in members]
        child = self._child(group, side, members, None if perm == sorted(perm) else perm, instance)
        self._record_split(t0)
        return child

    def _child(self, group, side, members: list[int], perm: list[int] | None, instance: str) -> TorchCommunicator:
        """A sub-communicator over ``group``/``side``: this one's timeout, device and ``stats`` (a rank's totals)."""
        child = type(self).__new__(type(self))
        child._blank()
        child._parent, child._root = self, self._root
        child._start(group, side, members, perm, instance, self.timeout, self.device, self._heartbeat_s,
                     self.diagnose_s)
        child.stats = self.stats
        self._children.append(child)
        return child

    def control(self) -> TorchCommunicator:
        """The control channel (see the contract and the module docstring); collective on its first call."""
        if self._control is not None:
            return self._control
        n, instance = self.world_size, f"{self._instance}.control"
        try:
            group, side = self._groups([0] * n, list(range(n)), 0, instance,
                                       self._parent is None and n == dist.get_world_size())
        except RuntimeError as e:  # DistError and Gloo's connect errors
            self._fail("control channel set-up", -1, e, is_timeout(e))
        self._control = self._child(group, side, self._members, self._perm, instance)
        self._control._control_of = self
        return self._control

    def close(self) -> None:
        """Stop the heartbeat and, if no collective failed, destroy the groups this communicator
        created (its sub-communicators first; a sub-communicator destroys only its own two groups,
        never its parent's). Idempotent. Not collective, so calling it while an exception unwinds
        (a ``finally``) does not delay the other ranks' failure detection. The rank hosting the
        store leaves last: it waits (at most ``diagnose_s`` + 0.5 s) for the other ranks to stop
        their heartbeats, or after a failure for them to finish naming the lost ranks. After a
        failure Gloo may still be inside the failed op and destroying would block until its
        timeout, so process exit cleans up instead. Also runs at exit."""
        if self._closed:
            return
        self._closed = True
        if self._parent is None:
            atexit.unregister(self.close)
        self._drop_launches()
        for child in self._children:
            child.close()
        hb, self._hb = self._hb, None
        if hb is not None:
            hb.stop("error" if self._broken else "closed")
            if self._parent is None and hb.store_host == self._members[self.rank]:
                hb.linger(self.diagnose_s + 2 * hb.interval, until_all_stopped=not self._broken)
        if self._root._tree_broken or not dist.is_initialized():
            return
        if self._side is not None:
            dist.destroy_process_group(self._side)
            self._side = None
        if self._parent is not None:
            dist.destroy_process_group(self.group)
        elif self._owns_pg:
            dist.destroy_process_group()
            self._owns_pg = False
