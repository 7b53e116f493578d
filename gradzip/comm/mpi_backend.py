"""``mpi``: mpi4py, no torch.distributed.

Start under ``mpirun``/``mpiexec``/``srun --mpi=pmix`` (or ``gradzip train --backend mpi --workers N``)
and create it with :func:`gradzip.comm.init_communicator` or ``MPICommunicator()``.

Data path:

- CPU tensors go **without copies** through their numpy views (``tensor.numpy()``); a
  non-contiguous tensor goes through one contiguous copy. Allgather and broadcast move raw bytes
  (``MPI.BYTE``), so any dtype works, packed ``uint8`` bits and bf16 included.
- allreduce of fp32/fp64/int*/uint8/complex uses ``MPI.SUM``; bool uses ``MPI.MAX`` on its
  byte view (any-true, as a torch bool sum). fp16/bf16 have no portable MPI datatype: they travel
  as 16-bit integers and are summed by a user-defined ``MPI.Op`` that adds them with torch (at the
  payload's precision at every step, like NCCL/Gloo). So the wire carries 2 bytes per element, as
  the byte accounting assumes; nothing is upcast.
- CUDA tensors: passed to MPI directly (through ``__cuda_array_interface__``/DLPack) when the MPI
  library is CUDA-aware (``MPIX_Query_cuda_support()``; override with
  ``GRADZIP_MPI_CUDA_AWARE=0|1``), after synchronising the current stream. Otherwise — and always
  for fp16/bf16 allreduce, whose user-defined op runs on the host — they are staged through pinned
  host memory.
- allgather with ``same_shape=True``: one ``Iallgather`` of the raw bytes into an ``(n, numel)``
  buffer, launched at once, staged like the rest (a CUDA tensor goes directly to a CUDA-aware
  MPI, else through pinned host memory); no header. No elements, or a world of one: copied locally.
- Variable-size allgather: ``Iallgather`` of a fixed-size header (collective number, dtype, shape)
  on a separate communicator, launched at once, then ``Iallgatherv`` of the bytes, deferred until
  the header is back in the process-wide FIFO of :mod:`gradzip.comm._common` (launched at the next
  issue that finds the header back, before any later launch on the data communicator, or before
  any wait blocks), so the launch never blocks and data collectives start in issue order. The
  header also catches ranks that are at different collectives or pass different dtypes. A CUDA
  payload is staged on the stream that was current at issue.
- alltoall: ``Ialltoall`` of the tensor's bytes (``MPI.BYTE``, n equal blocks) into a new tensor,
  staged like allgather (CUDA tensors go directly to a CUDA-aware MPI, else through pinned host
  memory, and the result comes back to the tensor's device). Shapes are not exchanged: every rank
  passes the same shape and dtype (the contract). A tensor without elements is copied locally.
- split: an ``Iallgather`` of ``(collective number, colour, key)`` on the header communicator
  (waited with the timeout and the diagnosis of any collective: a missing rank is named, never a
  hang), then ``MPI_Comm_split`` with the colour's index among the distinct colours and the rank's
  position in the ``(key, rank)`` order, so the new ranks are exactly :func:`~gradzip.comm.base.
  split_order`'s. The child is an ``MPICommunicator`` over that communicator: its own data, header
  and ping communicators and its own progress thread (pings are answered per communicator), the
  parent's ``stats`` and timeout. Its errors name **global** ranks (``MPI_COMM_WORLD``'s:
  "global rank(s) [3] not responding"). The parent's ``close()`` closes its children first; a
  child's ``close()`` is idempotent and frees only its own communicators.
- control: a child made the same way from a ``Dup()`` of this communicator, without a split (see
  :meth:`MPICommunicator.control`).

Open MPI progresses nonblocking collectives only inside MPI calls, so a progress thread calls
``MPI_Improbe`` every millisecond while collectives are in flight (every 20 ms otherwise); that is
what lets buckets travel while backward runs. It needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default);
set ``GRADZIP_MPI_PROGRESS_THREAD=0`` to disable it.

Timeouts and lost ranks: ``wait()`` polls ``Test()`` until ``self.timeout``. On expiry (or an MPI
error), the rank pings every peer on a control communicator for ``diagnose_s`` (2 s); the
progress thread and every waiting rank answer pings with how many collectives they have launched.
The :class:`~gradzip.errors.CommTimeout` then names the ranks that did not answer (dead or hung)
and the live ranks that have not reached the collective. A rank that *exits* is different: Open
MPI's runtime then terminates the whole job at once and ``mpirun`` names the rank that exited, so
no rank hangs. Run as ``mpiexec -n N python -m mpi4py -m gradzip ...`` (as ``spawn_local`` does) so
that an uncaught exception on one rank aborts every rank instead of blocking in ``MPI_Finalize``.

Bytes are accounted with :mod:`gradzip.comm.cost` (the header exchange is not counted, as in
``sim``; a split counts as ``sim`` counts it: op ``"split"``, an allgather of 16 bytes per rank);
seconds are measured launch → end of ``wait()``.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
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
from gradzip.comm._mpi_lib import cuda_aware_mpi, import_mpi, sum_16bit
from gradzip.comm._mpi_ping import PingChannel, rank_name
from gradzip.comm.base import DEFAULT_TIMEOUT_S, Handle, ReduceOp, check_alltoall, nbytes, split_order
from gradzip.errors import CommError, CommTimeout


class MPICommunicator(RealCommunicator):
    """mpi4py endpoint; see the module docstring."""

    backend = "mpi"

    def __init__(self, comm: Any = None, timeout: float = DEFAULT_TIMEOUT_S, *, diagnose_s: float = 2.0,
                 progress_thread: bool | None = None) -> None:
        MPI = self.MPI = import_mpi()
        base = comm if comm is not None else MPI.COMM_WORLD
        super().__init__(base.Get_rank(), base.Get_size(), timeout)
        self._children: list[MPICommunicator] = []  # from split() and control(); closed by our close()
        self._parent: MPICommunicator | None = None
        self._control: MPICommunicator | None = None  # control(), once made
        # MPI_COMM_WORLD's rank of each of our ranks, for messages (None: ours are those).
        world = MPI.COMM_WORLD.Get_group()
        group = base.Get_group()
        glob = [int(g) for g in group.Translate_ranks(list(range(self.world_size)), world)]
        group.Free()
        world.Free()
        self._global = None if glob == list(range(MPI.COMM_WORLD.Get_size())) else glob
        # Separate communicators: data collectives, size headers, and the ping channel.
        self._data, self._meta, self._ctl = base.Dup(), base.Dup(), base.Dup()
        for c in (self._data, self._meta, self._ctl):
            c.Set_errhandler(MPI.ERRORS_RETURN)
        self._pings = PingChannel(MPI, self._ctl, self._global)  # answers and sends pings
        self.diagnose_s = diagnose_s
        # Busy-poll a waited request for up to 1 ms, unless this host runs more ranks than it has
        # cores (then polling would take the CPU from the ranks that must make progress).
        local = base.Split_type(MPI.COMM_TYPE_SHARED)
        self._spin_s = 1e-3 if local.Get_size() <= (os.cpu_count() or 1) else 0.0
        local.Free()
        self._seq = 0  # collectives launched
        self._waiting = -1  # collective this rank is blocked in (for pings)
        self._inflight = 0
        self._broken = False
        self._tree_broken = False  # set by close(): this one or a sub-communicator failed
        self._closed = False
        self._responding = True  # tests switch it off to simulate a hung rank
        self._ops16 = {torch.float16: MPI.Op.Create(sum_16bit(torch.float16), commute=True),
                       torch.bfloat16: MPI.Op.Create(sum_16bit(torch.bfloat16), commute=True)}
        self._types = {
            torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int32: MPI.INT32_T,
            torch.int64: MPI.INT64_T, torch.int16: MPI.INT16_T, torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T,
            torch.complex64: MPI.C_FLOAT_COMPLEX, torch.complex128: MPI.C_DOUBLE_COMPLEX,
        }
        self._cuda_aware: bool | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if progress_thread is None:
            progress_thread = os.environ.get("GRADZIP_MPI_PROGRESS_THREAD", "1") != "0"
        if progress_thread and MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            self._thread = threading.Thread(target=self._progress_loop, name=f"gradzip-mpi-progress-{self.rank}",
                                            daemon=True)
            self._thread.start()
        self._wait_req(self._meta.Ibarrier(), -1, "init barrier")
        atexit.register(self.close)  # the progress thread must stop before mpi4py finalizes MPI

    # -- progress and pings -------------------------------------------------------------
    def _progress_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._answer_pings()  # MPI_Improbe also drives Open MPI's progress engine
            except Exception:
                return
            self._stop.wait(0.001 if self._inflight else 0.02)

    def _answer_pings(self) -> None:
        if self._responding:
            self._pings.answer(self._seq, self._waiting)

    def _diagnose(self, seq: int) -> str:
        """Ping every peer for ``diagnose_s`` s; say who did not answer and who is behind."""
        return self._pings.diagnose(seq, self.diagnose_s, self._answer_pings)


    def _where(self) -> str:
        """This rank, for messages: a communicator other than MPI_COMM_WORLD names the global rank first."""
        if self._global is None:
            return f"rank {self.rank}"
        return (f"{rank_name(self.rank, self._global)} (rank {self.rank} of the sub-communicator of global ranks "
                f"{self._global})")

    def _fail(self, desc: str, seq: int, err: BaseException | None) -> None:
        self._broken = True
        diag = self._diagnose(seq)
        if err is None:
            raise CommTimeout(f"{desc} timed out after {self.timeout:g} s on {self._where()}: {diag}")
        raise CommError(f"{desc} failed on {self._where()}: {diag} [mpi: {err}]") from err

    def _wait_req(self, req: Any, seq: int, desc: str, flush: bool = True) -> None:
        """Wait for ``req`` up to the timeout; ``flush``: first launch every deferred data collective
        (a rank never blocks with one unlaunched; header waits need not)."""
        if flush:
            flush_launches()
        self._waiting = seq
        start = time.monotonic()
        deadline = start + self.timeout
        try:
            while not req.Test():
                now = time.monotonic()
                if now - start < self._spin_s:  # small collectives finish within a few Test() calls: poll
                    continue
                self._answer_pings()
                if now > deadline:
                    self._fail(desc, seq, None)
                time.sleep(min(1e-3, (now - start) / 20))  # then back off, up to 1 ms
        except self.MPI.Exception as e:
            self._fail(desc, seq, e)
        finally:
            self._waiting = -1

    # -- buffers --------------------------------------------------------------------------
    def _device_ok(self, t: Tensor, host_op: bool = False) -> bool:
        """True: give MPI the tensor's own memory; False: stage a CUDA tensor through the host."""
        if not t.is_cuda:
            return True
        if host_op:
            return False
        if self._cuda_aware is None:
            self._cuda_aware = cuda_aware_mpi()
        if self._cuda_aware:
            torch.cuda.current_stream(t.device).synchronize()  # MPI reads outside CUDA's stream order
        return self._cuda_aware

    def _staged(self, t: Tensor, host_op: bool = False) -> tuple[Tensor, Callable[[], None] | None]:
        """(contiguous buffer MPI may use, write-back into ``t`` after an in-place op)."""
        if self._device_ok(t, host_op):
            return as_contiguous(t)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t)
        return host, lambda: t.copy_(host)

    @staticmethod
    def _buf(t: Tensor) -> Any:
        return t.numpy() if t.device.type == "cpu" else t

    def _handle(self, op: str, sent: int, recv: int, req: Any, seq: int, desc: str, t0: float,
                after: Callable[[], Any]) -> Handle:
        self._inflight += 1

        def finish() -> Any:
            try:
                self._wait_req(req, seq, desc)
            finally:
                self._inflight -= 1
            return after()

        return TimedHandle(self, op, sent, recv, finish, t0, lambda: bool(req.Test()))

    # -- the contract ---------------------------------------------------------------------
    def allreduce_async(self, tensor: Tensor, op: ReduceOp = "sum") -> Handle:
        self._check_op(op)
        MPI = self.MPI
        t0 = time.perf_counter()
        seq = self._next()
        desc = describe("allreduce", seq, tensor, op)
        dt = tensor.dtype
        buf, write_back = self._staged(tensor, host_op=dt in self._ops16)
        flat = buf.reshape(-1)
        if dt in self._ops16:
            spec, mpi_op = [self._buf(flat.view(torch.int16)), MPI.INT16_T], self._ops16[dt]
        elif dt == torch.bool:
            spec, mpi_op = [self._buf(flat.view(torch.uint8)), MPI.UINT8_T], MPI.MAX
        elif dt in self._types:
            spec, mpi_op = [self._buf(flat), self._types[dt]], MPI.SUM
        else:
            raise ValueError(f"mpi allreduce: unsupported dtype {dt}")
        flush_launches()  # deferred allgather data first: the data communicator sees issue order
        req = self._data.Iallreduce(MPI.IN_PLACE, spec, mpi_op)

        def after() -> Tensor:
            if write_back is not None:
                write_back()
            if op == "mean":
                mean_inplace(tensor, self.world_size)
            return tensor

        s = cost.allreduce_bytes(nbytes(tensor), self.world_size)
        return self._handle("allreduce", s, s, req, seq, desc, t0, after)

    def _allgather_same(self, tensor: Tensor, seq: int, desc: str, t0: float) -> Handle:
        n, shape = self.world_size, tensor.shape
        sent, recv = cost.allgather_bytes([nbytes(tensor)] * n, self.rank)
        if n == 1 or tensor.numel() == 0:  # nothing to exchange: every rank knows every shape
            out = torch.empty((n, tensor.numel()), dtype=tensor.dtype, device=tensor.device)
            out[0].copy_(tensor.reshape(-1))
            return TimedHandle(self, "allgather", sent, recv, lambda: [r.view(shape) for r in out], t0, lambda: True)
        src, _ = self._staged(tensor)
        out = torch.empty((n, tensor.numel()), dtype=tensor.dtype, device=src.device,
                          pin_memory=tensor.is_cuda and not src.is_cuda)
        send = self._buf(src.reshape(-1).view(torch.uint8))  # raw bytes: any dtype
        flush_launches()  # deferred allgather data first: the data communicator sees issue order
        req = self._data.Iallgather([send, self.MPI.BYTE], [self._buf(out.view(-1).view(torch.uint8)), self.MPI.BYTE])

        def after() -> list[Tensor]:
            full = out.to(tensor.device) if out.device != tensor.device else out
            return [r.view(shape) for r in full]

        return self._handle("allgather", sent, recv, req, seq, desc, t0, after)

    def _allgather_var(self, tensor: Tensor, seq: int, desc: str, t0: float) -> Handle:
        MPI, n, hdesc = self.MPI, self.world_size, desc + " size exchange"
        progress_launches()
        header, headers = encode_header(tensor, seq).numpy(), np.empty((n, HEADER_LEN), dtype=np.int64)
        hreq = self._meta.Iallgather(header, headers)
        self._inflight += 1  # the progress thread polls fast while it travels
        stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None
        got: dict[str, Any] = {}  # "req" (the data collective), "after" (() -> the results)

        def launch() -> None:  # from the FIFO, in issue order
            try:
                self._wait_req(hreq, seq, hdesc, flush=False)
            finally:
                self._inflight -= 1
            dtype, shapes = decode_headers(torch.from_numpy(headers), desc, self.rank, self._global)
            sizes = [math.prod(s) * tensor.element_size() for s in shapes]
            displs = [sum(sizes[:r]) for r in range(n)]
            handle.account(*cost.allgather_bytes(sizes, self.rank))
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                src, _ = self._staged(tensor)
                out = torch.empty(sum(sizes), dtype=torch.uint8, device=src.device,
                                  pin_memory=tensor.is_cuda and not src.is_cuda)
                send = self._buf(src.reshape(-1).view(torch.uint8))
                got["req"] = self._data.Iallgatherv([send, MPI.BYTE], [self._buf(out), (sizes, displs), MPI.BYTE])
            self._inflight += 1

            def after() -> list[Tensor]:
                full = out.to(tensor.device) if out.device != tensor.device else out
                return [full[d:d + s].view(dtype).view(shape) for d, s, shape in zip(displs, sizes, shapes)]

            got["after"] = after

        def finish() -> list[Tensor]:
            flush_launches()
            if item.error is not None:
                raise item.error
            try:
                self._wait_req(got["req"], seq, desc)
            finally:
                self._inflight -= 1
            return got["after"]()

        def poll() -> bool:
            progress_launches()
            return item.done and (item.error is not None or bool(got["req"].Test()))

        handle = TimedHandle(self, "allgather", 0, 0, finish, t0, poll)
        item = defer_launch(launch, lambda: bool(hreq.Test()), self)
        return handle

    def broadcast_async(self, tensor: Tensor, src: int = 0) -> Handle:
        self._check_src(src)
        MPI = self.MPI
        t0 = time.perf_counter()
        seq = self._next()
        desc = describe("broadcast", seq, tensor, f"from rank {src}")
        buf, write_back = self._staged(tensor)
        flush_launches()
        req = self._data.Ibcast([self._buf(buf.reshape(-1).view(torch.uint8)), MPI.BYTE], root=src)

        def after() -> Tensor:
            if write_back is not None:
                write_back()
            return tensor

        sent, recv = cost.broadcast_bytes(nbytes(tensor), self.world_size, self.rank, src)
        return self._handle("broadcast", sent, recv, req, seq, desc, t0, after)

    def alltoall_async(self, tensor: Tensor) -> Handle:
        check_alltoall(tensor, self.world_size)
        MPI = self.MPI
        t0 = time.perf_counter()
        seq = self._next()
        desc = describe("alltoall", seq, tensor)
        s = cost.alltoall_bytes(nbytes(tensor), self.world_size)
        if tensor.numel() == 0:  # nothing to exchange
            empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
            return TimedHandle(self, "alltoall", s, s, lambda: empty, t0, lambda: True)
        src, _ = self._staged(tensor)
        out = torch.empty(src.shape, dtype=src.dtype, device=src.device, pin_memory=tensor.is_cuda and not src.is_cuda)
        # Raw bytes in n equal blocks: any dtype, packed bits and bf16 included.
        send, recv = self._buf(src.reshape(-1).view(torch.uint8)), self._buf(out.view(-1).view(torch.uint8))
        flush_launches()
        req = self._data.Ialltoall([send, MPI.BYTE], [recv, MPI.BYTE])

        def after() -> Tensor:
            return out.to(tensor.device) if out.device != tensor.device else out

        return self._handle("alltoall", s, s, req, seq, desc, t0, after)

    def barrier(self) -> None:
        t0 = time.perf_counter()
        seq = self._next()
        flush_launches()
        self._wait_req(self._data.Ibarrier(), seq, f"barrier #{seq}")
        self.stats.record("barrier", 0, 0, time.perf_counter() - t0)

    def split(self, colour: int, key: int | None = None) -> MPICommunicator:
        """Collective: the ranks that pass the same ``colour`` form a new communicator (the same
        class, the same ``stats`` and timeout), ranked by ``(key, rank)``; ``key`` defaults to
        this rank. Sub-communicators of one parent must be created in the same order everywhere."""
        colour, key = int(colour), self.rank if key is None else int(key)
        t0 = time.perf_counter()
        seq = self._next()
        desc = f"split #{seq} (colour {colour}, key {key})"
        rows = np.empty((self.world_size, 3), dtype=np.int64)
        # Non-blocking and timed, unlike MPI_Comm_split: a missing rank is named here, not hung on.
        self._wait_req(self._meta.Iallgather(np.array([seq, colour, key], dtype=np.int64), rows), seq, desc)
        if len(set(rows[:, 0].tolist())) != 1:
            raise_mismatch(desc, self.rank, "collective numbers", rows[:, 0].tolist())
        colours, keys = rows[:, 1].tolist(), rows[:, 2].tolist()
        # MPI wants a non-negative int colour and an int key: pass the colour's index and our place.
        order = split_order(colours, keys, colour)
        try:
            base = self._meta.Split(sorted(set(colours)).index(colour), order.index(self.rank))
        except self.MPI.Exception as e:
            self._fail(desc, seq, e)
        try:
            child = type(self)(base, self.timeout, diagnose_s=self.diagnose_s, progress_thread=self._thread is not None)
        finally:
            base.Free()  # the child works on its own duplicates
        child.stats = self.stats  # a rank's totals cover all its traffic
        child._parent = self
        self._children.append(child)
        self._record_split(t0)
        return child

    def control(self) -> MPICommunicator:
        """The control channel (see the contract): an ``MPICommunicator`` over duplicates of this
        one's communicator (``MPI_Comm_dup``: a context of its own, so its collectives never match or
        wait behind this one's), with the same ranks, timeout and ``stats`` and its own progress
        thread; no collective of this one is numbered for it. Collective on its first call."""
        if self._control is None:
            child = type(self)(self._meta, self.timeout, diagnose_s=self.diagnose_s,
                               progress_thread=self._thread is not None)
            child.stats, child._parent = self.stats, self
            self._children.append(child)
            self._control = child
        self._control.timeout = self.timeout  # it follows this one's timeout
        return self._control

    def close(self) -> None:
        """Close the sub-communicators, stop the progress thread and free the communicators (not
        after a failure: freeing may wait on the failed operation). After a failure, first keep
        answering pings for ``diagnose_s``: once this rank exits, mpirun ends the job, and the other
        ranks may still be naming the lost ranks. Idempotent; a sub-communicator frees only its own
        communicators. Does not finalize MPI (mpi4py does that at exit)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._drop_launches()
        for child in self._children:  # before our own teardown: they may still answer pings
            child.close()
        # After a failure here or below, a peer may be gone: free nothing that may wait on it.
        self._tree_broken = self._broken or any(c._tree_broken for c in self._children)
        if self._broken:
            end = time.monotonic() + self.diagnose_s + 0.5
            while time.monotonic() < end:
                self._answer_pings()
                time.sleep(0.01)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._tree_broken or self.MPI.Is_finalized():
            return
        for c in (self._data, self._meta, self._ctl):
            c.Free()
        for o in self._ops16.values():
            o.Free()
