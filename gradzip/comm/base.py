"""The Communicator contract.

A Communicator is one rank's view of a group of ``world_size`` ranks. Backends: ``sim``
(N virtual workers in one process, :mod:`gradzip.comm.sim`), ``torch`` (Gloo/NCCL,
:mod:`gradzip.comm.torch_backend`) and ``mpi`` (mpi4py, :mod:`gradzip.comm.mpi_backend`).

Contract (every backend):

- ``allreduce_async(t, op)`` reduces ``t`` **in place** over ranks (``op`` is ``"sum"`` or
  ``"mean"``); ``wait()`` returns ``t``. Any dtype the backend can add (fp32, fp16, bf16, fp64,
  int32, int64).
- ``allgather_async(t, same_shape=False)``: every rank may pass a tensor of a different shape
  (same dtype); ``wait()`` returns the list of the ranks' tensors, indexed by rank, shapes
  preserved. Any dtype, including packed ``uint8`` bits. The real backends first exchange a small
  header (shapes) on a side channel, launched async, and launch the data collective once it is
  back: at the next launch that finds it back, and at the latest before this process launches a
  later data collective (which may then wait for the header) or blocks in any ``wait()``. So the
  launch itself never blocks, and data collectives start in issue order.
  ``same_shape=True``: the caller promises that every rank passes the same shape and dtype; no
  header is exchanged and the data collective is launched at once. Results and bytes counted are
  those of the variable form. ``sim`` checks the promise: ``wait()`` raises a
  :class:`gradzip.errors.CommError` naming the ranks that broke it, on every rank; the real
  backends trust it (a broken promise gives wrong results or an error there). Every rank passes
  the same ``same_shape``.
- ``broadcast_async(t, src)`` overwrites ``t`` in place with ``src``'s tensor.
- ``alltoall_async(t)``: ``t``'s first dimension (size a multiple of ``world_size``) is cut into
  ``world_size`` equal chunks; chunk ``j`` goes to rank ``j``. ``wait()`` returns a new tensor of
  ``t``'s shape and dtype whose chunk ``i`` is the chunk rank ``i`` sent to this rank. Every rank
  passes the same shape and dtype. Any dtype, packed ``uint8`` included.
- ``split(colour, key=None)``: collective over this communicator; ranks passing the same
  ``colour`` form a new communicator of the same backend, ranked by ``(key, rank)`` (``key``
  defaults to this rank). The new communicator records into the *same* ``stats`` as its parent,
  so a rank's totals cover all its traffic. Create sub-communicators at set-up, in the same order
  on every rank.
- ``barrier()``.
- ``control()``: a communicator over the same ranks, in the same order, for small bookkeeping
  collectives (per-step metrics, votes) on a channel of its own, so that they never queue behind
  this communicator's data collectives in flight (an outer sync's exchange that runs through the
  next inner steps). The first call is collective (make it at set-up, on every rank); later calls
  return the same object. It has the same backend, timeout and ``stats`` (a rank's totals cover
  all its traffic), its own collective numbering, and its parent's ``close()`` closes it. A
  backend whose collectives cannot queue behind one another (``sim``) returns itself.
- The synchronous forms are ``op_async(...).wait()``.
- A communicator whose ranks share one node has ``intra = True`` (``sim``: from ``ranks_per_node``;
  real backends: the node communicator of :func:`gradzip.comm.topology.topology`); its bytes are
  also counted in ``stats.intra_bytes_sent``, so that ``bytes_sent − intra_bytes_sent`` is what
  crossed between nodes.
- Every call records in ``self.stats`` the bytes this rank sends and receives, by the algorithm
  formulas of :mod:`gradzip.comm.cost` (so all backends count identically), and the time it took:
  measured wall time for real backends, modelled α–β time for ``sim`` (``clock == "modelled"``).
- Every init and collective has a timeout (``timeout`` seconds, default 300). On expiry, or when a
  peer dies, the call raises :class:`gradzip.errors.CommError` naming the operation and the rank
  that was lost, never hangs silently.
- Calls are issued in the same order on every rank (as with MPI/NCCL).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from torch import Tensor

ReduceOp = Literal["sum", "mean"]
DEFAULT_TIMEOUT_S = 300.0


@dataclass
class OpTotals:
    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    seconds: float = 0.0


@dataclass
class CommStats:
    """Running totals for one rank. ``snapshot()`` then ``since(snap)`` gives per-step deltas."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    seconds: float = 0.0
    calls: int = 0
    by_op: dict[str, OpTotals] = field(default_factory=dict)
    intra_bytes_sent: int = 0  # the part of bytes_sent that stayed inside this rank's node

    def record(self, op: str, sent: int, recv: int, seconds: float, intra: bool = False) -> None:
        self.bytes_sent += sent
        self.bytes_recv += recv
        if intra:
            self.intra_bytes_sent += sent
        self.seconds += seconds
        self.calls += 1
        t = self.by_op.setdefault(op, OpTotals())
        t.calls += 1
        t.bytes_sent += sent
        t.bytes_recv += recv
        t.seconds += seconds

    def snapshot(self) -> tuple[int, int, float, int, int]:
        return (self.bytes_sent, self.bytes_recv, self.seconds, self.calls, self.intra_bytes_sent)

    def since(self, snap: tuple[int, int, float, int, int]) -> dict[str, float]:
        return {
            "bytes_sent": self.bytes_sent - snap[0],
            "bytes_recv": self.bytes_recv - snap[1],
            "seconds": self.seconds - snap[2],
            "calls": self.calls - snap[3],
            "intra_bytes_sent": self.intra_bytes_sent - snap[4],
        }

    def reset(self) -> None:
        self.bytes_sent = self.bytes_recv = self.calls = self.intra_bytes_sent = 0
        self.seconds = 0.0
        self.by_op.clear()


class Handle(ABC):
    """An outstanding collective. ``wait()`` blocks (up to the communicator's timeout)."""

    @abstractmethod
    def wait(self) -> Any:
        """Block until done; return the result (see the op). Raises CommError on failure."""

    def is_completed(self) -> bool:
        return False


class DoneHandle(Handle):
    """A handle whose result is already there (synchronous backends, world size 1)."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def wait(self) -> Any:
        return self._result

    def is_completed(self) -> bool:
        return True


class Communicator(ABC):
    """One rank's endpoint. See the module docstring for the contract."""

    backend: ClassVar[str] = ""
    clock: ClassVar[Literal["measured", "modelled"]] = "measured"
    intra: bool = False  # every rank of this communicator is on one node (see the contract)
    # What times local work (encodes, decodes, compute): wall time where time is measured.
    work_time: ClassVar[Callable[[], float]] = staticmethod(time.perf_counter)

    def __init__(self, rank: int, world_size: int, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.stats = CommStats()

    # -- the contract ---------------------------------------------------------------
    @abstractmethod
    def allreduce_async(self, tensor: Tensor, op: ReduceOp = "sum") -> Handle: ...

    @abstractmethod
    def allgather_async(self, tensor: Tensor, same_shape: bool = False) -> Handle:
        """Gather every rank's ``tensor``; ``same_shape=True``: every rank promises the same shape and
        dtype, so no header is exchanged (see the contract)."""

    @abstractmethod
    def broadcast_async(self, tensor: Tensor, src: int = 0) -> Handle: ...

    @abstractmethod
    def alltoall_async(self, tensor: Tensor) -> Handle: ...

    @abstractmethod
    def split(self, colour: int, key: int | None = None) -> Communicator: ...

    @abstractmethod
    def barrier(self) -> None: ...

    def control(self) -> Communicator:
        """The control channel (see the contract). Here: this communicator itself, for backends
        whose collectives never wait behind an earlier one in flight."""
        return self

    def close(self) -> None:
        """Release resources. Idempotent."""

    # -- synchronous forms ----------------------------------------------------------
    def allreduce(self, tensor: Tensor, op: ReduceOp = "sum") -> Tensor:
        return self.allreduce_async(tensor, op).wait()

    def allgather(self, tensor: Tensor, same_shape: bool = False) -> list[Tensor]:
        return self.allgather_async(tensor, same_shape).wait()

    def broadcast(self, tensor: Tensor, src: int = 0) -> Tensor:
        return self.broadcast_async(tensor, src).wait()

    def alltoall(self, tensor: Tensor) -> Tensor:
        return self.alltoall_async(tensor).wait()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank}/{self.world_size}>"


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def check_alltoall(tensor: Tensor, world_size: int) -> None:
    """The shape rule of ``alltoall``: a first dimension that ``world_size`` divides."""
    if tensor.dim() == 0 or tensor.shape[0] % world_size:
        raise ValueError(f"alltoall needs a tensor whose first dimension is a multiple of the world size "
                         f"{world_size}, got shape {tuple(tensor.shape)}")


def split_order(colours: list[int], keys: list[int], colour: int) -> list[int]:
    """Old ranks of the group of ``colour``, in new-rank order (by key, then old rank)."""
    members = [r for r, c in enumerate(colours) if c == colour]
    return sorted(members, key=lambda r: (keys[r], r))
