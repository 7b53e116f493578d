"""Pieces shared by the real backends (``torch`` and ``mpi``): their common base class
(:class:`RealCommunicator`: collective numbering, argument checks, the dispatch between the two
allgather forms, the accounting of split), timed handles that record stats exactly as ``sim``
does, the shape header of the variable-size allgather, the queue of its deferred data launches,
and error messages.

Accounting: every handle is created with the bytes its op sends/receives by the formulas of
:mod:`gradzip.comm.cost` (not by what the library happens to put on the wire: padding, headers and
the size exchange of the variable allgather are not counted, exactly as in ``sim``). Seconds are
measured from launch to the end of ``wait()``.
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gradzip.comm import cost
from gradzip.comm.base import Communicator, Handle, ReduceOp
from gradzip.errors import CommError

# Dtype codes for the allgather header; the order is part of the wire format.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
    torch.uint8, torch.int8, torch.int16, torch.bool, torch.complex64, torch.complex128,
)
MAX_NDIM = 8
HEADER_LEN = 3 + MAX_NDIM  # seq, dtype code, ndim, dims...
SPLIT_ROW_BYTES = 16  # split accounts an allgather of (colour, key) as int64, as sim does


class RealCommunicator(Communicator):
    """What the ``torch`` and ``mpi`` communicators share. A subclass numbers its collectives with
    :meth:`_next` (``_seq``: how many it launched), names this rank in messages with ``_where()``
    and implements the two allgather forms."""

    _seq: int

    def _next(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _where(self) -> str:
        """This rank, for messages."""
        return f"rank {self.rank}"

    def _check(self, t: Tensor) -> None:
        """Refuse a tensor this backend cannot communicate (by default: none)."""

    @staticmethod
    def _check_op(op: ReduceOp) -> None:
        if op not in ("sum", "mean"):
            raise ValueError(f"unknown reduce op {op!r}; use 'sum' or 'mean'")

    def _check_src(self, src: int) -> None:
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src {src} out of range for world size {self.world_size}")

    def allgather_async(self, tensor: Tensor, same_shape: bool = False) -> Handle:
        """See the contract and the backend's module docstring: ``same_shape=True`` launches the data
        at once (no header); otherwise the header goes first and the data launch is deferred."""
        self._check(tensor)
        t0 = time.perf_counter()
        seq = self._next()
        if same_shape:
            return self._allgather_same(tensor, seq, describe("allgather", seq, tensor, "same shape"), t0)
        return self._allgather_var(tensor, seq, describe("allgather", seq, tensor), t0)

    @abstractmethod
    def _allgather_same(self, tensor: Tensor, seq: int, desc: str, t0: float) -> Handle: ...

    @abstractmethod
    def _allgather_var(self, tensor: Tensor, seq: int, desc: str, t0: float) -> Handle: ...

    def _record_split(self, t0: float) -> None:
        """Account a split started at ``t0`` as ``sim`` does: an allgather of 16 bytes per rank."""
        sent, recv = cost.allgather_bytes([SPLIT_ROW_BYTES] * self.world_size, self.rank)
        self.stats.record("split", sent, recv, time.perf_counter() - t0)

    def _drop_launches(self) -> None:
        """On close: take this communicator's deferred allgather launches out of the queue."""
        drop_launches(self, f"allgather on {self._where()}: the communicator was closed before the data "
                            "collective was launched")


def encode_header(t: Tensor, seq: int) -> Tensor:
    """int64 header [seq, dtype code, ndim, d0..d7] describing ``t`` for the allgather."""
    if t.dim() > MAX_NDIM:
        raise ValueError(f"allgather supports tensors of at most {MAX_NDIM} dims, got shape {tuple(t.shape)}")
    if t.dtype not in DTYPES:
        raise ValueError(f"allgather: unsupported dtype {t.dtype}; supported: {[str(d) for d in DTYPES]}")
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0], h[1], h[2] = seq, DTYPES.index(t.dtype), t.dim()
    if t.dim():
        h[3:3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def decode_headers(headers: Tensor, op: str, rank: int,
                   members: list[int] | None = None) -> tuple[torch.dtype, list[torch.Size]]:
    """Shapes per rank from the gathered ``(n, HEADER_LEN)`` headers (rows in this communicator's
    rank order); checks that every rank is at the same collective with the same dtype (a mismatch
    would otherwise corrupt data silently). ``members``: the global ranks of a sub-communicator,
    named in the error."""
    rows = headers.tolist()
    try:
        seqs = [r[0] for r in rows]
        if len(set(seqs)) != 1:
            raise_mismatch(op, rank, "collective numbers", seqs)
        codes = [r[1] for r in rows]
        if len(set(codes)) != 1:
            raise_mismatch(op, rank, "dtypes", [str(DTYPES[c]) if 0 <= c < len(DTYPES) else c for c in codes])
    except CommError as e:
        if members is None:
            raise
        raise CommError(f"{e} (ranks of the sub-communicator of global ranks {members})") from None
    shapes = [torch.Size(r[3:3 + r[2]]) for r in rows]
    return DTYPES[codes[0]], shapes


def raise_mismatch(op: str, rank: int, what: str, per_rank: list[Any]) -> None:
    detail = ", ".join(f"rank {r}: {v}" for r, v in enumerate(per_rank))
    raise CommError(f"{op} on rank {rank}: ranks disagree on {what} ({detail}); every rank must issue the same "
                    "collectives in the same order")


def describe(op: str, seq: int, t: Tensor | None = None, extra: str = "") -> str:
    """'allreduce #7 (4.0 KiB torch.float16, mean)' for error messages."""
    parts = []
    if t is not None:
        parts.append(f"{human_bytes(t.numel() * t.element_size())} {str(t.dtype).replace('torch.', '')}")
    if extra:
        parts.append(extra)
    return f"{op} #{seq}" + (f" ({', '.join(parts)})" if parts else "")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class TimedHandle(Handle):
    """Runs ``finish()`` once on the first ``wait()``, then records (op, sent, recv, launch→end
    seconds) in the communicator's stats. Later waits return the cached result (or raise the
    same error again)."""

    def __init__(self, comm: Communicator, op: str, sent: int, recv: int, finish: Callable[[], Any],
                 t0: float | None = None, poll: Callable[[], bool] | None = None) -> None:
        self._comm, self._op, self._sent, self._recv = comm, op, sent, recv
        self._finish: Callable[[], Any] | None = finish
        self._poll = poll
        self._t0 = time.perf_counter() if t0 is None else t0
        self._result: Any = None
        self._error: BaseException | None = None

    def account(self, sent: int, recv: int) -> None:
        """Set the bytes to record (an op that learns its sizes after launch: the variable allgather)."""
        self._sent, self._recv = sent, recv

    def wait(self) -> Any:
        if self._error is not None:  # a failed op stays failed
            raise self._error
        if self._finish is not None:
            finish, self._finish = self._finish, None
            try:
                self._result = finish()
            except BaseException as e:
                self._error = e
                raise
            self._comm.stats.record(self._op, self._sent, self._recv, time.perf_counter() - self._t0,
                                    self._comm.intra)
        return self._result

    def is_completed(self) -> bool:
        if self._finish is None or self._error is not None:
            return True
        return bool(self._poll()) if self._poll is not None else False


def as_contiguous(t: Tensor) -> tuple[Tensor, Callable[[], None] | None]:
    """(a contiguous tensor to communicate, a write-back to call after an in-place op, or None)."""
    if t.is_contiguous():
        return t, None
    tmp = t.contiguous()
    return tmp, lambda: t.copy_(tmp)


def mean_inplace(t: Tensor, n: int) -> None:
    """Divide a summed tensor by ``n`` the way ``sim`` does: integer dtypes truncate."""
    with torch.no_grad():
        if t.is_floating_point() or t.is_complex():
            t.div_(n)
        elif t.dtype != torch.bool:
            t.copy_(t.to(torch.float64).div_(n))


# -- deferred launches ------------------------------------------------------------------------
# A variable-shape allgather launches its header exchange at once and its data collective only
# when the header is back. The data launches of this process wait in ONE process-wide FIFO, in
# issue order, across all communicators: so this process launches data collectives in exactly the
# order they were issued (what Gloo's per-group FIFOs, MPI and NCCL need, NCCL across communicators
# too), as if each had been launched at issue. The rules, kept by the backends:
#
# - ``progress_launches()`` (never blocks) at every issue and ``is_completed()``: launch the
#   leading items whose header is back;
# - ``flush_launches()`` before launching any other collective on a data channel, and before
#   blocking in any wait: launch every item, waiting for headers as needed.
#
# So a rank that blocks has launched every data collective it issued, as with launch-at-issue:
# no wait can deadlock on a data launch that another rank deferred. A header wait is safe to block
# on: every rank launched the header when it issued the allgather.


class Deferred:
    """One deferred data launch. ``ready()``: would ``launch()`` return without blocking (the header
    is back)? ``launch()``: wait for the header and launch the data collective. Once run, ``done``
    is True and ``error`` is what ``launch()`` raised (raised again by the op's ``wait()``)."""

    __slots__ = ("ready", "launch", "owner", "done", "error")

    def __init__(self, launch: Callable[[], None], ready: Callable[[], bool], owner: object) -> None:
        self.launch, self.ready, self.owner = launch, ready, owner
        self.done = False
        self.error: BaseException | None = None


_deferred: deque[Deferred] = deque()
_deferred_lock = threading.RLock()
_flushing = False  # a launch in progress (guards against re-entry from inside a launch)


def defer_launch(launch: Callable[[], None], ready: Callable[[], bool], owner: object) -> Deferred:
    """Queue a data launch of communicator ``owner`` behind every launch deferred before it (see
    the rules above)."""
    item = Deferred(launch, ready, owner)
    with _deferred_lock:
        _deferred.append(item)
    return item


def drop_launches(owner: object, why: str) -> None:
    """Remove ``owner``'s deferred launches (it is closing: its groups are going away); their
    ops' ``wait()`` raises a CommError saying ``why``."""
    with _deferred_lock:
        for item in [d for d in _deferred if d.owner is owner]:
            _deferred.remove(item)
            item.error, item.done = CommError(why), True


def progress_launches() -> None:
    """Launch the leading deferred items whose headers are back, in order; never blocks."""
    _drain(block=False)


def flush_launches() -> None:
    """Launch every deferred item, in order, waiting for headers as needed."""
    _drain(block=True)


def pending_launches() -> int:
    """Deferred data launches not started yet (tests)."""
    return len(_deferred)


def _drain(block: bool) -> None:
    global _flushing
    if not _deferred and not _flushing:  # the common case, without the lock
        return
    with _deferred_lock:  # another thread's drain finishes first
        if _flushing:  # re-entered from inside a launch on this thread
            return
        _flushing = True
        try:
            while _deferred and (block or _ready(_deferred[0])):
                item = _deferred.popleft()
                try:
                    item.launch()
                except Exception as e:  # a communication failure: the op's wait() raises it
                    item.error = e
                except BaseException as e:  # KeyboardInterrupt and the like: recorded, and passed on
                    item.error = e
                    raise
                finally:
                    item.done = True
        finally:
            _flushing = False


def _ready(item: Deferred) -> bool:
    try:
        return bool(item.ready())
    except Exception:  # a failed header: launch() reports it
        return True
