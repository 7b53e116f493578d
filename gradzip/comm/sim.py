"""``sim``: N virtual workers inside one process.

:class:`SimWorld` owns ``n`` :class:`SimCommunicator` endpoints. The i-th collective issued by
every endpoint forms one operation; it completes when the last worker launches it, and its result
is then exactly what the real collective computes (sum/mean in fp32 and cast back, allgather of
per-rank shapes, broadcast of the root's tensor). ``allgather(same_shape=True)`` checks the
caller's promise that every rank passes the same shape and dtype, which the real backends trust:
a broken one is a CommError, from every rank's ``wait()``, naming the ranks that differ.

Two ways to drive it:

- single-threaded (default, what the engine does): every worker *launches* an async collective
  before any worker *waits* on it. Waiting on an operation that some worker has not launched yet is
  an error naming those workers, never a hang.
- ``threaded=True``: one thread per worker; ``wait()`` blocks until the others arrive, up to the
  timeout, and then names the workers that never came.

Time is a virtual clock: each operation is charged its α–β time from :mod:`gradzip.comm.cost` for
the world's :class:`Link` (``clock == "modelled"``). Bytes are counted with the same formulas as
the real backends.

Two link levels: with ``ranks_per_node=k``, workers ``0..k-1`` share node 0, and so on. A group
(the whole world or a :meth:`SimCommunicator.split` of it) inside one node runs on the intra-node
link (``intra_bandwidth``, ``intra_latency``); a group that spans nodes is paced by the inter-node
link. Groups of one split that cross the same node's network card at the same time (one group per
local rank) share its bandwidth; an alltoall that spans nodes sends the traffic of every rank of
a node through that node's card (:func:`gradzip.comm.cost.alltoall_time`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import Tensor

from gradzip.comm import cost
from gradzip.comm._common import mean_inplace
from gradzip.comm.base import DEFAULT_TIMEOUT_S, Communicator, Handle, ReduceOp, check_alltoall, nbytes, split_order
from gradzip.errors import CommError, CommTimeout
from gradzip.units import parse_bandwidth, parse_latency


class _Op:
    __slots__ = ("kind", "arg", "inputs", "results", "done", "modelled_s", "error")

    def __init__(self, kind: str, arg: Any, n: int) -> None:
        self.kind = kind
        self.arg = arg  # reduce op, broadcast src, or allgather's "same_shape=<bool>"
        self.inputs: list[Tensor | None] = [None] * n
        self.results: list[Any] = [None] * n
        self.done = False
        self.modelled_s = 0.0
        self.error: CommError | None = None  # completed, but failed: every rank's wait() raises it


class SimHandle(Handle):
    def __init__(self, world: SimWorld, seq: int, rank: int) -> None:
        self.world, self.seq, self.rank = world, seq, rank

    @property
    def modelled_s(self) -> float:
        """The operation's modelled duration (valid once completed)."""
        return self.world._ops_done_time.get(self.seq, 0.0)

    def is_completed(self) -> bool:
        op = self.world._ops.get(self.seq)
        return op is None or op.done

    def wait(self) -> Any:
        return self.world._wait(self.seq, self.rank)


class SimWorld:
    """``n`` virtual workers connected by a modelled link (two levels with ``ranks_per_node``)."""

    def __init__(self, n: int, bandwidth: str | float = "1gbit", latency: str | float = "50us",
                 timeout: float = DEFAULT_TIMEOUT_S, threaded: bool = False, *, ranks_per_node: int = 1,
                 intra_bandwidth: str | float = "100gbit", intra_latency: str | float = "5us") -> None:
        if n < 1:
            raise ValueError(f"sim world size must be >= 1, got {n}")
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        self.n = n
        self.ranks_per_node = ranks_per_node
        self.inter = cost.Link(parse_bandwidth(bandwidth), parse_latency(latency))
        self.intra = cost.Link(parse_bandwidth(intra_bandwidth), parse_latency(intra_latency))
        self.timeout = timeout
        self.threaded = threaded
        self.members = list(range(n))  # global ranks of this (sub)world, by its rank
        self.share = 1  # concurrent groups of one split through each node's card
        self._ops: dict[int, _Op] = {}
        self._ops_done_time: dict[int, float] = {}
        self._cond = threading.Condition()
        self._lock = self._cond
        self.comms = [SimCommunicator(self, r) for r in range(n)]

    @property
    def nodes(self) -> list[int]:
        """The node of each member of this world, by rank."""
        return [g // self.ranks_per_node for g in self.members]

    @property
    def per_node(self) -> int:
        """The most members of this world on one node."""
        nodes = self.nodes
        return max(nodes.count(x) for x in set(nodes))

    @property
    def link(self) -> cost.Link:
        """The link that paces this world's collectives: intra-node if every member shares a node."""
        if len(set(self.nodes)) == 1:
            return self.intra
        return cost.Link(self.inter.bandwidth_bps / self.share, self.inter.latency_s)

    def __getitem__(self, rank: int) -> SimCommunicator:
        return self.comms[rank]

    def __iter__(self):
        return iter(self.comms)

    def __len__(self) -> int:
        return self.n

    # -- matching -------------------------------------------------------------------
    def _launch(self, rank: int, kind: str, tensor: Tensor | None, arg: Any = None) -> SimHandle:
        comm = self.comms[rank]
        seq = comm._seq
        comm._seq += 1
        with self._cond:
            op = self._ops.get(seq)
            if op is None:
                op = self._ops[seq] = _Op(kind, arg, self.n)
            elif (op.kind, op.arg) != (kind, arg):
                raise CommError(f"sim: collective #{seq} mismatch: rank {rank} called {kind}({arg}) "
                                f"but another rank called {op.kind}({op.arg})")
            op.inputs[rank] = tensor if tensor is not None else torch.empty(0)
            if all(x is not None for x in op.inputs):
                self._complete(seq, op)
                self._cond.notify_all()
        return SimHandle(self, seq, rank)

    def _wait(self, seq: int, rank: int) -> Any:
        with self._cond:
            op = self._ops.get(seq)
            if op is None:
                raise CommError(f"sim: collective #{seq} on rank {rank} was already consumed")
            if not op.done:
                if not self.threaded:
                    missing = [r for r, x in enumerate(op.inputs) if x is None]
                    raise CommError(f"sim: {op.kind} #{seq}: rank {rank} waited before rank(s) {missing} "
                                    "launched it; launch on every worker before waiting")
                deadline = time.monotonic() + self.timeout
                while not op.done:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        missing = [r for r, x in enumerate(op.inputs) if x is None]
                        raise CommTimeout(f"sim: {op.kind} #{seq} timed out after {self.timeout:g}s on rank "
                                          f"{rank}: lost rank(s) {missing}")
                    self._cond.wait(left)
            result = op.results[rank]
            op.results[rank] = None
            op.inputs[rank] = None
            if all(x is None for x in op.inputs):  # every rank has collected: free it
                del self._ops[seq]
            if op.error is not None:
                raise op.error
            return result

    def _complete(self, seq: int, op: _Op) -> None:
        ins: list[Tensor] = op.inputs  # type: ignore[assignment]
        n, link = self.n, self.link
        intra = len(set(self.nodes)) == 1
        if op.kind == "allreduce":
            dt = ins[0].dtype  # exact integer sums, as Gloo/MPI do; floats accumulate in fp32 (fp64 stays)
            acc_dtype = dt if dt in (torch.float64, torch.int64) else (
                torch.float32 if dt.is_floating_point or dt == torch.bool else torch.int64)
            acc = ins[0].to(acc_dtype, copy=True)
            for t in ins[1:]:
                acc += t
            if op.arg == "mean":
                mean_inplace(acc, n)
            for t in ins:
                t.copy_(acc)
            op.results = list(ins)
            size = nbytes(ins[0])
            op.modelled_s = cost.allreduce_time(size, n, link)
            for r in range(n):
                s = cost.allreduce_bytes(size, n)
                self.comms[r].stats.record("allreduce", s, s, op.modelled_s, intra)
        elif op.kind == "allgather":
            op.error = _broken_same_shape(seq, ins) if op.arg == "same_shape=True" else None
            if op.error is not None:  # nothing is gathered or counted; every rank's wait() raises
                self._ops_done_time[seq] = 0.0
                op.done = True
                return
            sizes = [nbytes(t) for t in ins]
            op.modelled_s = cost.allgather_time(sizes, link)
            op.results = [[t.clone() for t in ins] for _ in range(n)]
            for r in range(n):
                s, rcv = cost.allgather_bytes(sizes, r)
                self.comms[r].stats.record("allgather", s, rcv, op.modelled_s, intra)
        elif op.kind == "alltoall":
            views = [t.reshape(n, t.shape[0] // n, *t.shape[1:]) for t in ins]  # equal first-dim chunks
            op.results = [torch.cat([v[r] for v in views], 0) for r in range(n)]
            size = nbytes(ins[0])
            spans = len(set(self.nodes)) > 1
            op.modelled_s = cost.alltoall_time(size, n, link, self.per_node if spans else 1, self.intra)
            for r in range(n):
                s = cost.alltoall_bytes(size, n)
                self.comms[r].stats.record("alltoall", s, s, op.modelled_s, intra)
        elif op.kind == "split":
            op.results = self._split([int(t[0]) for t in ins], [int(t[1]) for t in ins])
            op.modelled_s = cost.allgather_time([16] * n, link)  # the colours travel as an allgather
            for r in range(n):
                s, rcv = cost.allgather_bytes([16] * n, r)
                self.comms[r].stats.record("split", s, rcv, op.modelled_s)
        elif op.kind == "broadcast":
            src = op.arg
            for r, t in enumerate(ins):
                if r != src:
                    t.copy_(ins[src])
            op.results = list(ins)
            size = nbytes(ins[src])
            op.modelled_s = cost.broadcast_time(size, n, link)
            for r in range(n):
                s, rcv = cost.broadcast_bytes(size, n, r, src)
                self.comms[r].stats.record("broadcast", s, rcv, op.modelled_s, intra)
        else:  # barrier
            op.results = [None] * n
            op.modelled_s = cost.barrier_time(n, link)
            for r in range(n):
                self.comms[r].stats.record("barrier", 0, 0, op.modelled_s)
            if not self.threaded:  # nobody waits on a single-threaded barrier: free it now
                del self._ops[seq]
        self._ops_done_time[seq] = op.modelled_s
        if op.kind == "split" and not self.threaded:  # the endpoints are already bound: free it
            del self._ops[seq]
        if len(self._ops_done_time) > 4096:  # bounded: only recent ops are asked about
            for k in sorted(self._ops_done_time)[:2048]:
                del self._ops_done_time[k]
        op.done = True


    def _split(self, colours: list[int], keys: list[int]) -> list[SimCommunicator]:
        """Build one sub-world per colour and bind each caller's pending endpoint to it."""
        groups = {c: split_order(colours, keys, c) for c in sorted(set(colours))}
        worlds: dict[int, SimWorld] = {}
        for c, ranks in groups.items():
            sub = SimWorld.__new__(SimWorld)
            sub.n, sub.ranks_per_node, sub.inter, sub.intra = len(ranks), self.ranks_per_node, self.inter, self.intra
            sub.timeout, sub.threaded = self.timeout, self.threaded
            sub.members = [self.members[r] for r in ranks]
            sub.share, sub._ops, sub._ops_done_time = 1, {}, {}
            sub._cond = sub._lock = threading.Condition()
            sub.comms = []
            worlds[c] = sub
        # Groups that span nodes at once share each node's card: count them per node.
        spanning = [w for w in worlds.values() if len(set(w.nodes)) > 1]
        per_node: dict[int, int] = {}
        for w in spanning:
            for node in set(w.nodes):
                per_node[node] = per_node.get(node, 0) + 1
        for w in spanning:  # a split of a split also shares the card with the parent's siblings
            w.share = self.share * max(per_node[node] for node in set(w.nodes))
        bound: dict[int, SimCommunicator] = {}
        for c, ranks in groups.items():
            for new_rank, old in enumerate(ranks):
                child = bound[old] = self.comms[old]._pending.pop(0)
                child._bind(worlds[c], new_rank)
                worlds[c].comms.append(child)
        return [bound[r] for r in range(self.n)]


def _broken_same_shape(seq: int, ins: list[Tensor]) -> CommError | None:
    """The error of an ``allgather(same_shape=True)`` whose ranks passed different shapes or dtypes
    (None: the promise holds). The ranks named are those that differ from the most common
    (shape, dtype), ties going to the lowest rank's."""
    kinds = [(tuple(t.shape), t.dtype) for t in ins]
    if len(set(kinds)) == 1:
        return None
    common = max(kinds, key=lambda k: (kinds.count(k), -kinds.index(k)))
    odd = [r for r, k in enumerate(kinds) if k != common]
    each = ", ".join(f"rank {r}: {shape} {str(dt).replace('torch.', '')}" for r, (shape, dt) in enumerate(kinds))
    return CommError(f"sim: allgather #{seq} with same_shape=True: rank(s) {odd} passed a different shape or dtype "
                     f"than the others ({each}); every rank must pass the same shape and dtype, or use "
                     "same_shape=False for payloads whose size differs between ranks")


_WORK_SCALE = [1.0]  # one process hosts one sim run at a time: set by gradzip train per run


def set_work_scale(factor: float) -> None:
    """The CPU time of local work on this run's threads over its CPU time on one thread (the
    threads' own overhead, >= 1), measured by the caller; 1 for one thread."""
    if not (factor >= 1.0 and factor < float("inf")):
        raise ValueError(f"work scale must be a finite number >= 1, got {factor}")
    _WORK_SCALE[0] = float(factor)


class SimCommunicator(Communicator):
    """One virtual worker's endpoint in a :class:`SimWorld`."""

    backend = "sim"
    clock = "modelled"

    def work_time(self) -> float:
        """Local work is timed in this process's CPU time (every thread's), divided by
        :func:`set_work_scale`'s factor: one-thread CPU seconds. Other processes on the machine, and
        how many threads torch uses, then change no modelled number."""
        return time.process_time() / _WORK_SCALE[0]

    def __init__(self, world: SimWorld, rank: int) -> None:
        super().__init__(rank, world.n, world.timeout)
        self.world = world
        self._seq = 0
        self._pending: list[SimCommunicator] = []  # split() endpoints not bound yet

    def __getattr__(self, name: str) -> Any:  # only for attributes not set yet: an unbound split
        if name in ("rank", "world_size", "world", "_seq"):
            raise CommError("sim: this communicator comes from a split() that not every worker has called yet; "
                            "call split on every worker before using the new communicators")
        raise AttributeError(name)

    def _bind(self, world: SimWorld, rank: int) -> None:
        self.world, self.rank, self.world_size, self._seq = world, rank, world.n, 0
        self.timeout = world.timeout

    @property
    def intra(self) -> bool:  # type: ignore[override]
        return len(set(self.world.nodes)) == 1

    @property
    def node(self) -> int:
        """This worker's node (global rank // ranks_per_node)."""
        return self.world.members[self.rank] // self.world.ranks_per_node

    def alltoall_async(self, tensor: Tensor) -> Handle:
        check_alltoall(tensor, self.world_size)
        return self.world._launch(self.rank, "alltoall", tensor)

    def split(self, colour: int, key: int | None = None) -> SimCommunicator:
        """See the contract. Single-threaded, the endpoint is returned at once and becomes usable
        when every worker has called ``split``; threaded, the call waits for the others."""
        child = SimCommunicator.__new__(SimCommunicator)
        child.stats, child._pending = self.stats, []  # one account per rank, parent and children
        self._pending.append(child)
        ck = torch.tensor([int(colour), self.rank if key is None else int(key)], dtype=torch.int64)
        h = self.world._launch(self.rank, "split", ck)
        if self.world.threaded:
            h.wait()
        return child

    def allreduce_async(self, tensor: Tensor, op: ReduceOp = "sum") -> Handle:
        if op not in ("sum", "mean"):
            raise ValueError(f"unknown reduce op {op!r}; use 'sum' or 'mean'")
        return self.world._launch(self.rank, "allreduce", tensor, op)

    def allgather_async(self, tensor: Tensor, same_shape: bool = False) -> Handle:
        """See the contract. ``same_shape=True`` is checked: if the ranks' shapes or dtypes differ,
        ``wait()`` raises a CommError on every rank naming the ranks that differ. Every rank must
        pass the same ``same_shape`` (a mismatch is an error at launch, as for any other op)."""
        return self.world._launch(self.rank, "allgather", tensor, f"same_shape={bool(same_shape)}")

    def broadcast_async(self, tensor: Tensor, src: int = 0) -> Handle:
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src {src} out of range for world size {self.world_size}")
        return self.world._launch(self.rank, "broadcast", tensor, src)

    def barrier(self) -> None:
        # Single-threaded: a barrier cannot block, so it is charged and left for the others.
        h = self.world._launch(self.rank, "barrier", None)
        if self.world.threaded:
            h.wait()
