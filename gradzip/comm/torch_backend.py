"""``torch``: torch.distributed process groups — Gloo on CPU, NCCL on CUDA.

Create it through :func:`gradzip.comm.init_communicator` (which reads the launcher's environment),
or directly::

    comm = TorchCommunicator("gloo", rank=r, world_size=n, master_addr="10.0.0.1", master_port=29500)
    comm = TorchCommunicator()          # over a default process group that already exists (DDP code)

How each collective maps onto torch.distributed (all ``async_op=True``; ``wait()`` enforces
``self.timeout``):

- allreduce: ``all_reduce(SUM)`` in place, then ``/ world_size`` for ``mean``. Gloo (torch 2.13)
  reduces fp32/fp64/fp16/bf16/int*/uint8 natively, so nothing is upcast: fp16/bf16 are summed in
  their own precision at every ring step (as NCCL does), which can differ from ``sim``'s fp32
  accumulation by a rounding of the payload dtype. Non-contiguous tensors go through a copy.
- allgather of per-rank shapes: (1) a small fixed-size allgather of a header (collective number,
  dtype, shape) on a separate Gloo group, so it never queues behind large data ops; it is the one
  blocking step of the launch (one latency). It also checks that all ranks are at the same
  collective with the same dtype. (2) ``all_gather`` of the flattened payloads padded to the
  largest, launched async; ``wait()`` trims and reshapes (results are views of one buffer).
- broadcast: ``broadcast`` in place. barrier: a Gloo barrier on the side group.

Bytes are accounted with :mod:`gradzip.comm.cost` (padding and the header are not counted, as in
``sim``); seconds are measured launch → end of ``wait()``.

Failure detection. Every rank runs a heartbeat thread that writes ``beat, collectives launched,
state`` into the rendezvous store every 0.25 s. When a collective fails (Gloo reports a closed
connection at once when a peer dies; NCCL only by timeout) or times out, the rank watches the
heartbeats for ``diagnose_s`` (2 s) and names, in the :class:`~gradzip.errors.CommError`, the ranks
whose heartbeat stopped (lost), the ones that reported an error themselves, and live ranks that
have not launched the collective yet. So the error arrives at most ``timeout + diagnose_s`` after
``wait()`` began. If the store itself is gone, its host (rank 0, unless torchrun's agent hosts it)
is named as lost.
"""

from __future__ import annotations

import atexit
import fcntl
import math
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from gradzip.comm import cost
from gradzip.comm._common import (
    HEADER_LEN,
    TimedHandle,
    as_contiguous,
    decode_headers,
    describe,
    encode_header,
    mean_inplace,
)
from gradzip.comm.base import DEFAULT_TIMEOUT_S, Communicator, Handle, ReduceOp, nbytes
from gradzip.errors import CommError, CommTimeout, GradzipError

_HB_PREFIX = "gradzip_hb/"


class _Heartbeat:
    """Liveness and progress of every rank through the rendezvous store (see module docstring)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, progress: Callable[[], int],
                 interval: float = 0.25, store_host: int | None = 0, instance: int = 0) -> None:
        self.store, self.rank, self.n = store, rank, world_size
        self.instance = instance  # communicators are created in the same order on every rank
        self.progress = progress  # () -> collectives launched so far
        self.interval = interval
        self.store_host = store_host  # the rank whose process serves the store (None: torchrun's agent)
        self.state = "ok"
        self._beat = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._paused = False  # tests: simulate a hung rank
        self._write()  # synchronously, so that every key exists after the init barrier
        self._thread = threading.Thread(target=self._run, name=f"gradzip-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _key(self, r: int) -> str:
        return f"{_HB_PREFIX}{self.instance}/{r}"

    def _write(self) -> None:
        with self._lock:
            self._beat += 1
            self.store.set(self._key(self.rank), f"{self._beat} {self.progress()} {self.state}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self._paused:
                continue
            try:
                self._write()
            except Exception:  # store gone (its host exited): nothing left to tell
                return

    def pause(self) -> None:
        """Stop beating but keep the thread (tests use it to simulate a hung rank)."""
        self._paused = True

    def set_state(self, state: str) -> None:
        self.state = state
        try:
            self._write()
        except Exception:
            pass

    def stop(self, state: str = "closed") -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.set_state(state)

    def linger(self, seconds: float, until_all_stopped: bool) -> None:
        """Keep the store (served by this process) up for the others: until every other rank has
        stopped its heartbeat (``until_all_stopped``), or for ``seconds`` (they are diagnosing)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if until_all_stopped:
                cur = self._read()
                if cur is None or all(cur[r][2] != "ok" for r in range(self.n) if r != self.rank):
                    return
            time.sleep(self.interval / 5)

    def _read(self) -> dict[int, tuple[int, int, str]] | None:
        try:
            vals = self.store.multi_get([self._key(r) for r in range(self.n)])
        except Exception:
            return None
        out = {}
        for r, v in enumerate(vals):
            beat, seq, state = v.decode().split(" ", 2)
            out[r] = (int(beat), int(seq), state)
        return out

    def diagnose(self, seq: int, window: float) -> str:
        """Watch the heartbeats for up to ``window`` s and describe who is lost or behind."""
        first = self._read()
        if first is None:
            return self._store_gone_text()
        others = [r for r in range(self.n) if r != self.rank]
        advanced: set[int] = set()
        last = first
        t0 = time.monotonic()
        store_gone = False
        settled = {r for r in others if first[r][2] != "ok"}  # reported an error, or closed
        while time.monotonic() < t0 + window and len(advanced | settled) < len(others):
            time.sleep(self.interval)
            cur = self._read()
            if cur is None:  # e.g. rank 0 exited after its own error: judge by what was seen so far
                store_gone = True
                break
            last = cur
            advanced |= {r for r in others if cur[r][0] != first[r][0]}
            settled |= {r for r in others if cur[r][2] != "ok"}
        watched = time.monotonic() - t0
        failed = [r for r in others if last[r][2].startswith("error")]
        closed = [r for r in others if last[r][2] == "closed"]
        silent = [r for r in others if r not in advanced and r not in failed and r not in closed]
        # A heartbeat is only called lost after several missed beats.
        lost = silent if watched >= 3 * self.interval else []
        behind = {r: last[r][1] for r in others
                  if r in advanced and 0 <= last[r][1] <= seq and r not in failed and r not in closed}
        parts = []
        if lost:
            parts.append(f"lost rank(s) {lost} (no heartbeat for {watched:.1f} s)")
        if failed:
            parts.append(f"rank(s) {failed} failed themselves (see their logs)")
        if closed:
            parts.append(f"rank(s) {closed} closed their communicator (finished, or failed outside a collective)")
        if behind:
            parts.append("alive but not at this collective yet: " + ", ".join(
                f"rank {r} (last launched #{k - 1})" if k else f"rank {r} (launched none)" for r, k in behind.items()))
        if store_gone:
            parts.append(self._store_gone_text(exited_after_error=self.store_host in failed + closed))
        return "; ".join(parts) or "no rank is lost: every heartbeat advances and every rank launched it"

    def _store_gone_text(self, exited_after_error: bool = False) -> str:
        if self.store_host is None:
            return "the torchrun agent's store is unreachable (the agent or its host is gone)"
        if exited_after_error:
            return f"rank {self.store_host} then exited, taking the rendezvous store it hosts with it"
        return f"lost rank {self.store_host} (the rendezvous store it hosts is unreachable)"


class TorchCommunicator(Communicator):
    """torch.distributed endpoint; see the module docstring."""

    backend = "torch"
    _instances = 0  # per process; keys the heartbeats of several communicators apart

    def __init__(self, backend: str | None = None, rank: int | None = None, world_size: int | None = None, *,
                 master_addr: str | None = None, master_port: int | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, device: torch.device | None = None,
                 heartbeat_s: float = 0.25, diagnose_s: float = 2.0) -> None:
        self._owns_pg = not dist.is_initialized()
        self._broken = False
        self._hb: _Heartbeat | None = None
        self._side = None
        if self._owns_pg:
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            rank = int(os.environ["RANK"]) if rank is None and "RANK" in os.environ else rank
            world_size = int(os.environ["WORLD_SIZE"]) if world_size is None and "WORLD_SIZE" in os.environ \
                else world_size
            if rank is None or world_size is None:
                raise GradzipError("torch backend: rank and world size unknown: start under torchrun/mpirun/srun, "
                                   "use `gradzip train --workers N`, or pass rank= and world_size=")
            _init_process_group(backend, rank, world_size, master_addr, master_port, timeout, device)
        self.group = dist.group.WORLD
        self.dist_backend = dist.get_backend(self.group)
        super().__init__(dist.get_rank(), dist.get_world_size(), timeout)
        self.device = device or (torch.device("cuda", torch.cuda.current_device())
                                 if self.dist_backend == "nccl" else torch.device("cpu"))
        self.diagnose_s = diagnose_s
        self._seq = 0
        td = timedelta(seconds=timeout)
        # A Gloo side group for size headers and barriers: never queued behind large data ops.
        self._side = dist.new_group(backend="gloo", timeout=td)
        store = dist.distributed_c10d._get_default_store()
        try:
            store = store.clone()  # its own connection: the heartbeat thread never contends with c10d
        except Exception:
            pass
        host = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0
        TorchCommunicator._instances += 1
        self._hb = _Heartbeat(store, self.rank, self.world_size, lambda: self._seq, heartbeat_s, host,
                              TorchCommunicator._instances)
        self._wait_work(dist.barrier(group=self._side, async_op=True), -1, "init barrier")
        atexit.register(self.close)  # also on an uncaught CommError: see close()

    # -- timeout also bounds the ops inside Gloo/NCCL -----------------------------------
    @property
    def timeout(self) -> float:
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout = float(value)
        # Our own groups only: a process group adopted from the user (DDP) keeps its timeout.
        groups = (getattr(self, "group", None) if getattr(self, "_owns_pg", False) else None,
                  getattr(self, "_side", None))
        for g in groups:
            if g is not None:
                try:
                    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=self._timeout), g)
                except Exception:  # private API; our own wait() timeout still applies
                    pass

    # -- helpers ------------------------------------------------------------------------
    def _next(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _fail(self, desc: str, seq: int, err: BaseException, timed_out: bool) -> None:
        self._broken = True
        if self._hb is not None:
            self._hb.set_state(f"error:{desc}")
            diag = self._hb.diagnose(seq, self.diagnose_s)
        else:
            diag = "no heartbeat available"
        what = f"timed out after {self.timeout:g} s" if timed_out else "failed"
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        detail = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", detail).split(". This is")[0]  # Gloo's source path
        # The backend's own words add nothing to "timed out" (they stay in the chained exception).
        said = "" if timed_out and _is_timeout(RuntimeError(detail)) else f" [{self.dist_backend}: {detail}]"
        cls = CommTimeout if timed_out else CommError
        raise cls(f"{desc} {what} on rank {self.rank}: {diag}{said}") from err

    def _launch(self, desc: str, seq: int, fn: Callable[[], dist.Work]) -> dist.Work:
        try:
            return fn()
        except dist.DistError as e:  # communication failures; bad arguments (ValueError etc.) pass through
            self._fail(desc, seq, e, _is_timeout(e))
            raise  # unreachable: _fail raises

    def _wait_work(self, work, seq: int, desc: str) -> None:
        try:
            ok = work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as e:
            self._fail(desc, seq, e, _is_timeout(e))
        else:
            if ok is False:
                self._fail(desc, seq, TimeoutError("work.wait returned False"), True)

    def _check(self, t: Tensor) -> None:
        if self.dist_backend == "nccl" and not t.is_cuda:
            raise ValueError(f"NCCL communicator needs CUDA tensors, got one on {t.device}")

    # -- the contract -------------------------------------------------------------------
    def allreduce_async(self, tensor: Tensor, op: ReduceOp = "sum") -> Handle:
        if op not in ("sum", "mean"):
            raise ValueError(f"unknown reduce op {op!r}; use 'sum' or 'mean'")
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

    def allgather_async(self, tensor: Tensor) -> Handle:
        self._check(tensor)
        t0 = time.perf_counter()
        seq = self._next()
        desc = describe("allgather", seq, tensor)
        n = self.world_size
        header = encode_header(tensor, seq)
        headers = torch.empty(n, HEADER_LEN, dtype=torch.int64)
        w = self._launch(desc, seq, lambda: dist.all_gather(list(headers.unbind(0)), header, self._side,
                                                            async_op=True))
        self._wait_work(w, seq, desc + " size exchange")
        dtype, shapes = decode_headers(headers, desc, self.rank)
        numels = [math.prod(s) for s in shapes]
        sent, recv = cost.allgather_bytes([k * tensor.element_size() for k in numels], self.rank)
        m = max(numels)
        if m == 0:
            empties = [torch.empty(s, dtype=dtype, device=tensor.device) for s in shapes]
            return TimedHandle(self, "allgather", sent, recv, lambda: empties, t0)
        flat = tensor.reshape(-1)
        if flat.numel() == m:
            padded = flat.contiguous()
        else:  # pad to the largest; the tail is never read
            padded = flat.new_empty(m)
            padded[:flat.numel()].copy_(flat)
        out = torch.empty((n, m), dtype=dtype, device=tensor.device)
        work = self._launch(desc, seq, lambda: dist.all_gather(list(out.unbind(0)), padded, self.group,
                                                               async_op=True))

        def finish() -> list[Tensor]:
            self._wait_work(work, seq, desc)
            return [out[r, :numels[r]].view(shapes[r]) for r in range(n)]

        return TimedHandle(self, "allgather", sent, recv, finish, t0, work.is_completed)

    def broadcast_async(self, tensor: Tensor, src: int = 0) -> Handle:
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src {src} out of range for world size {self.world_size}")
        self._check(tensor)
        t0 = time.perf_counter()
        seq = self._next()
        desc = describe("broadcast", seq, tensor, f"from rank {src}")
        buf, write_back = as_contiguous(tensor)
        work = self._launch(desc, seq, lambda: dist.broadcast(buf, src, self.group, async_op=True))

        def finish() -> Tensor:
            self._wait_work(work, seq, desc)
            if write_back is not None:
                write_back()
            return tensor

        sent, recv = cost.broadcast_bytes(nbytes(tensor), self.world_size, self.rank, src)
        return TimedHandle(self, "broadcast", sent, recv, finish, t0, work.is_completed)

    def barrier(self) -> None:
        t0 = time.perf_counter()
        seq = self._next()
        work = self._launch(f"barrier #{seq}", seq, lambda: dist.barrier(group=self._side, async_op=True))
        self._wait_work(work, seq, f"barrier #{seq}")
        self.stats.record("barrier", 0, 0, time.perf_counter() - t0)

    def close(self) -> None:
        """Stop the heartbeat and, if this communicator created the process group and no collective
        failed, destroy it. Not collective, so calling it while an exception unwinds (a
        ``finally``) does not delay the other ranks' failure detection. The rank hosting the
        store leaves last: it waits (at most ``diagnose_s`` + 0.5 s) for the other ranks to stop
        their heartbeats, or after a failure for them to finish naming the lost ranks. After a
        failure Gloo may still be inside the failed op and destroying would block until its
        timeout, so process exit cleans up instead. Also runs at exit."""
        atexit.unregister(self.close)
        hb, self._hb = self._hb, None
        if hb is not None:
            hb.stop("error" if self._broken else "closed")
            if hb.store_host == self.rank:
                hb.linger(self.diagnose_s + 2 * hb.interval, until_all_stopped=not self._broken)
        if self._broken or not dist.is_initialized():
            return
        if self._side is not None:
            dist.destroy_process_group(self._side)
            self._side = None
        if self._owns_pg:
            dist.destroy_process_group()
            self._owns_pg = False


def _is_timeout(e: BaseException) -> bool:
    s = str(e).lower()
    return isinstance(e, TimeoutError) or "timed out" in s or "timeout" in s


def _init_process_group(backend: str, rank: int, world_size: int, addr: str | None, port: int | None,
                        timeout: float, device: torch.device | None) -> None:
    if backend not in ("gloo", "nccl"):
        raise GradzipError(f"torch backend {backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (CUDA)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise GradzipError("backend nccl needs CUDA, but torch.cuda.is_available() is False; use --backend gloo")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        init_method = "env://"  # torchrun's agent hosts the store: survives the loss of rank 0
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    else:
        addr = addr or os.environ.get("MASTER_ADDR")
        port = port or (int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None)
        if not addr or not port:
            raise GradzipError("torch backend: rendezvous address unknown: set MASTER_ADDR and MASTER_PORT "
                               "(rank 0's host and a free port)")
        host = f"[{addr}]" if ":" in addr else addr
        init_method, where = f"tcp://{host}:{port}", f"{addr}:{port}"
    _bind_gloo_to_addr()
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = device or torch.device("cuda", torch.cuda.current_device())
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout), **kwargs)
    except (RuntimeError, TimeoutError) as e:
        msg = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        cls = CommTimeout if _is_timeout(e) else CommError
        raise cls(f"init: rank {rank} of {world_size} could not rendezvous at {where} within {timeout:g} s: {msg}. "
                  f"Check that all {world_size} ranks were started and that rank 0's host and port are "
                  "reachable") from e


def _bind_gloo_to_addr() -> None:
    """``GRADZIP_BIND_ADDR`` (set per rank by ``spawn_local(bind_addrs=...)``): make Gloo use the
    interface that owns this address (Gloo reads ``GLOO_SOCKET_IFNAME`` when it creates its device)."""
    addr = os.environ.get("GRADZIP_BIND_ADDR")
    if not addr or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    ifname = _interface_of(addr)
    if ifname is None:
        raise GradzipError(f"GRADZIP_BIND_ADDR={addr} is not an address of any interface on this host")
    os.environ["GLOO_SOCKET_IFNAME"] = ifname


def _interface_of(addr: str) -> str | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
            except OSError:
                continue
            if got == addr:
                return name
    finally:
        sock.close()
    return None
