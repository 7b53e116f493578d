"""The battery of collectives that checks a backend against ``sim`` (the reference).

:func:`run_battery` covers every op of the contract: allreduce/allgather/broadcast over many
dtypes and shapes, alltoall (fp32/fp16/bf16/int64/uint8/bool/complex64, 2-D and 3-D, a first
dimension of exactly the world size, no elements, a non-contiguous view, async overlap, and the
ValueError of a first dimension the world size does not divide), and split (parity colours with
reversed keys, a split of that split, and an all-ranks reversed split; inside each: allreduce,
variable-size and ``same_shape`` allgather, broadcast from sub-rank 0, alltoall, barrier; the
parent's stats must grow by the children's bytes), and ``allgather(same_shape=True)`` (many
dtypes and shapes; that it launches exactly one collective and no header exchange, counted at
the backend's library calls by :func:`count_collectives`; that neither allgather form blocks at
launch while a peer is late; waits in a different order on different ranks, across
communicators, without deadlock; a mix of outstanding variable and same-shape allgathers).

Every input is a function of rank and world size (:func:`alltoall_input`,
:func:`same_shape_input`), so that :mod:`gradzip.testing.comm_selftest` can recompute what every
rank must have received. The command line, the checks and the failure phase live there.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from gradzip.comm.base import Communicator

ALLREDUCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
                    torch.uint8, torch.bool)
ALLTOALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool,
                   torch.complex64)
# alltoall cases: name -> (dtype, shape for world size n). The first dimension is a multiple of n.
ALLTOALL_CASES: dict[str, tuple[torch.dtype, Any]] = {
    **{f"{dt}": (dt, lambda n: (3 * n, 5)) for dt in ALLTOALL_DTYPES},  # 2-D, 3 rows per chunk
    "exact": (torch.int64, lambda n: (n,)),  # first dimension = world size: one element per chunk
    "f16_3d": (torch.float16, lambda n: (2 * n, 2, 3)),
    "empty": (torch.float32, lambda n: (0,)),  # no elements: 0 is a multiple of every world size
    "empty_rows": (torch.uint8, lambda n: (2 * n, 0)),
}
# allgather(same_shape=True) cases: name -> (dtype, shape), the same on every rank.
SAME_SHAPE_CASES: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
    **{str(dt): (dt, (3, 5)) for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
                                        torch.int64, torch.int8, torch.uint8, torch.bool, torch.complex64)},
    "f32_3d": (torch.float32, (2, 3, 4)),
    "scalar": (torch.int64, ()),
    "empty": (torch.float32, (0, 4)),
    "one": (torch.uint8, (1,)),
}
LATE_S = 1.5  # how late rank 0 comes to the non-blocking launch check


def _make(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.3
    if dtype == torch.uint8:
        return torch.randint(0, 60, shape, generator=g, dtype=torch.uint8)  # 4 ranks: no overflow
    return torch.randint(-50, 50, shape, generator=g, dtype=dtype)


def alltoall_input(dtype: torch.dtype, shape: tuple[int, ...], rank: int, tag: int = 0) -> Tensor:
    """Rank ``rank``'s alltoall input: a function of its arguments only, so that any rank (and
    :func:`self_check`) can recompute what every other rank sent."""
    g = torch.Generator().manual_seed(7919 * (rank + 1) + 101 * tag + 13 * len(shape) + sum(shape))
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    return _make(dtype, shape, g)


def expected_alltoall(inputs: list[Tensor], rank: int) -> Tensor:
    """What ``rank`` receives when rank i passes ``inputs[i]``: chunk i is chunk ``rank`` of it."""
    n = len(inputs)
    return torch.cat([t.reshape(n, t.shape[0] // n, *t.shape[1:])[rank] for t in inputs], 0)


def split_members(n: int, colour_of, key_of) -> dict[int, list[int]]:
    """Old ranks of each colour's group, in new-rank order (by key, then old rank)."""
    groups: dict[int, list[int]] = {}
    for r in sorted(range(n), key=lambda r: (key_of(r), r)):
        groups.setdefault(colour_of(r), []).append(r)
    return groups


def same_shape_input(dtype: torch.dtype, shape: tuple[int, ...], rank: int) -> Tensor:
    """Rank ``rank``'s input to the same-shape allgather case of ``dtype`` and ``shape``."""
    return alltoall_input(dtype, shape, rank, 5)


class CollectiveCount:
    """What :func:`count_collectives` saw: ``data`` collectives and ``header`` exchanges launched."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self._start = comm._seq if comm.backend == "sim" else 0  # type: ignore[attr-defined]
        self._data = self.header = 0

    @property
    def data(self) -> int:
        if self._comm.backend == "sim":  # sim has no header exchange: its ops are its collectives
            return self._comm._seq - self._start  # type: ignore[attr-defined]
        return self._data


@contextlib.contextmanager
def count_collectives(comm: Communicator) -> Iterator[CollectiveCount]:
    """Count the collectives ``comm`` launches inside the block, at the library: ``torch`` wraps
    torch.distributed's collectives (by group: ``comm.group`` is data, the Gloo side group header);
    ``mpi`` wraps the data and header communicators (every nonblocking ``I...`` call); ``sim`` counts
    its ops (no headers)."""
    count = CollectiveCount(comm)
    if comm.backend == "torch":
        import torch.distributed as dist

        names = ("all_gather", "all_gather_single", "all_gather_into_tensor", "all_reduce", "broadcast",
                 "all_to_all_single", "all_to_all", "barrier")
        originals = {k: getattr(dist, k) for k in names if hasattr(dist, k)}
        depth = threading.local()

        def counting(fn: Any) -> Any:
            sig = inspect.signature(fn)

            def call(*args: Any, **kwargs: Any) -> Any:
                if not getattr(depth, "n", 0):  # not a call one of these makes inside another
                    group = sig.bind(*args, **kwargs).arguments.get("group")
                    if group is comm._side:  # type: ignore[attr-defined]
                        count.header += 1
                    elif group is comm.group:  # type: ignore[attr-defined]
                        count._data += 1
                depth.n = getattr(depth, "n", 0) + 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    depth.n -= 1

            return call

        for k, fn in originals.items():
            setattr(dist, k, counting(fn))
        try:
            yield count
        finally:
            for k, fn in originals.items():
                setattr(dist, k, fn)
    elif comm.backend == "mpi":
        data, meta = comm._data, comm._meta  # type: ignore[attr-defined]
        comm._data = _CountingComm(data, lambda: setattr(count, "_data", count._data + 1))  # type: ignore[attr-defined]
        comm._meta = _CountingComm(meta, lambda: setattr(count, "header", count.header + 1))  # type: ignore[attr-defined]
        try:
            yield count
        finally:
            comm._data, comm._meta = data, meta  # type: ignore[attr-defined]
    elif comm.backend == "sim":
        yield count
    else:
        raise ValueError(f"count_collectives: unknown backend {comm.backend!r}")


class _CountingComm:
    """An mpi4py communicator whose nonblocking calls (``Iallgather``, ``Iallreduce``...) are counted."""

    def __init__(self, inner: Any, tick: Any) -> None:
        self._inner, self._tick = inner, tick

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not (name.startswith("I") and callable(attr)):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._tick()
            return attr(*args, **kwargs)

        return call


def _launch_checks(comm: Communicator, g_rank: int, out: dict[str, Tensor], prefix: str) -> None:
    """On ``comm`` (world size > 1): a same-shape allgather launches one data collective and no
    header; a variable one launches only its header at issue (its data is deferred; ``sim``: one
    op), then one data collective."""
    real = comm.backend != "sim"
    with count_collectives(comm) as c:
        got = comm.allgather(same_shape_input(torch.float32, (4, 3), g_rank), same_shape=True)
    out[f"{prefix}/same_calls"] = torch.tensor([c.data, c.header], dtype=torch.int64)  # want [1, 0]
    out[f"{prefix}/same_result"] = torch.stack(got)
    with count_collectives(comm) as c:
        h = comm.allgather_async(torch.arange(g_rank + 2, dtype=torch.int16))
        at_issue = (c.data, c.header)
        got = h.wait()
    ok = at_issue == ((0, 1) if real else (1, 0)) and (c.data, c.header) == ((1, 1) if real else (1, 0))
    out[f"{prefix}/var_calls_ok"] = torch.tensor(ok)  # the probe sees headers, and the launch is deferred
    for k, x in enumerate(got):
        out[f"{prefix}/var_result/{k}"] = x


def _sub_battery(sub: Communicator, g_rank: int, tag: int, out: dict[str, Tensor], prefix: str) -> None:
    """allreduce, a variable-size and a same-shape allgather, a broadcast, an alltoall and a
    barrier inside a sub-communicator; inputs are functions of the *global* rank, so results are
    checkable."""
    n = sub.world_size
    out[f"{prefix}/rank"] = torch.tensor([sub.rank, n], dtype=torch.int64)
    out[f"{prefix}/allreduce"] = sub.allreduce(torch.full((5,), float(g_rank + 1)), "sum")
    for k, x in enumerate(sub.allgather(torch.arange(g_rank + 1, dtype=torch.int32) + 100 * g_rank)):
        out[f"{prefix}/allgather/{k}"] = x
    for k, x in enumerate(sub.allgather(torch.full((3, 2), g_rank + 0.5).bfloat16(), same_shape=True)):
        out[f"{prefix}/allgather_same/{k}"] = x
    out[f"{prefix}/broadcast"] = sub.broadcast(torch.full((7,), float(g_rank)).bfloat16(), src=0)
    out[f"{prefix}/alltoall"] = sub.alltoall(alltoall_input(torch.int64, (2 * n, 3), g_rank, tag))
    sub.barrier()


def run_battery(comm: Communicator) -> dict[str, Tensor]:
    """Every collective of the contract; returns named results (same on all backends)."""
    r, n = comm.rank, comm.world_size
    g = torch.Generator().manual_seed(1000 + r)
    out: dict[str, Tensor] = {}
    for dt in ALLREDUCE_DTYPES:
        for op in ("sum", "mean"):
            for numel in (1003, 1, 0):
                t = _make(dt, (numel,), g)
                out[f"allreduce/{dt}/{op}/{numel}"] = comm.allreduce(t, op)
    base = torch.randn(8, 6, generator=g)
    comm.allreduce(base.t(), "mean")  # non-contiguous view: the base is updated in place
    out["allreduce/noncontiguous"] = base
    cases: dict[str, Tensor] = {
        "f32": torch.randn(r + 1, 3, generator=g),
        "u8": torch.randint(0, 256, (5 * r,), generator=g, dtype=torch.uint8),  # rank 0: empty
        "i32": torch.arange(7 + r, dtype=torch.int32) * (r + 1),
        "bf16": torch.randn(2, r + 2, generator=g).bfloat16(),
        "scalar": torch.tensor(float(r)),
        "empty": torch.empty(0, 4),
        "bool": torch.rand(r + 3, generator=g) > 0.5,
        "f16_3d": torch.randn(r % 2 + 1, 2, 3, generator=g).half(),
    }
    for name, t in cases.items():
        for k, x in enumerate(comm.allgather(t)):
            out[f"allgather/{name}/{k}"] = x
    for name, (dt, shape) in SAME_SHAPE_CASES.items():
        for k, x in enumerate(comm.allgather(same_shape_input(dt, shape, r), same_shape=True)):
            out[f"same/{name}/{k}"] = x
    x = torch.arange(24, dtype=torch.float64).reshape(4, 6)[:, ::2] * (r + 1)  # a non-contiguous view
    for k, y in enumerate(comm.allgather(x, same_shape=True)):
        out[f"same/noncontiguous/{k}"] = y
    t = torch.randn(33, generator=g) + r
    out["broadcast/f32"] = comm.broadcast(t, src=n - 1)
    out["broadcast/u8"] = comm.broadcast(torch.randint(0, 256, (17,), generator=g, dtype=torch.uint8), src=0)
    out["broadcast/bf16"] = comm.broadcast(torch.randn(5, 3, generator=g).bfloat16(), src=1 % n)
    # Several outstanding operations at once, waited on in reverse order.
    a = torch.randn(1 << 16, generator=g)
    b = torch.randint(0, 256, (1000 + 10 * r,), generator=g, dtype=torch.uint8)
    c = torch.randn(100, generator=g).half()
    d = torch.randn(9, generator=g)
    handles = [comm.allreduce_async(a, "mean"), comm.allgather_async(b), comm.broadcast_async(d, src=0),
               comm.allreduce_async(c, "sum")]
    results = [h.wait() for h in reversed(handles)][::-1]
    out["overlap/a"], out["overlap/d"], out["overlap/c"] = results[0], results[2], results[3]
    for k, x in enumerate(results[1]):
        out[f"overlap/b/{k}"] = x
    # alltoall: every case, then one launched async behind an allreduce and waited on first.
    for name, (dt, shape) in ALLTOALL_CASES.items():
        out[f"alltoall/{name}"] = comm.alltoall(alltoall_input(dt, shape(n), r))
    base = torch.arange(4 * 2 * n, dtype=torch.float32).reshape(4, 2 * n) * (r + 1)
    out["alltoall/noncontiguous"] = comm.alltoall(base.t())  # a (2n, 4) transposed view
    h1 = comm.allreduce_async(torch.ones(64) * r, "sum")
    h2 = comm.alltoall_async(alltoall_input(torch.uint8, (n, 9), r, 1))
    out["alltoall/async"], out["alltoall/async_ar"] = h2.wait(), h1.wait()
    out["alltoall/bad_input"] = torch.tensor([_bad_alltoall(comm, (n + 1,)), _bad_alltoall(comm, ())])
    # split: colour = parity, key = -rank (reversed order), then a split of the split (reversed
    # again, so the same members in ascending order) and one all-ranks split (one group, reversed).
    snap = comm.stats.snapshot()
    sub = comm.split(r % 2, key=-r)
    out["split/shared_stats"] = torch.tensor(sub.stats is comm.stats)
    _sub_battery(sub, r, 2, out, "split")
    subsub = sub.split(0, key=-sub.rank)
    _sub_battery(subsub, r, 3, out, "split/split")
    rev = comm.split(0, key=n - r)
    _sub_battery(rev, r, 4, out, "split/all")
    grew = comm.stats.since(snap)
    out["split/stats_delta"] = torch.tensor([grew["calls"], grew["bytes_sent"], grew["bytes_recv"]],
                                            dtype=torch.int64)
    _allgather_launches(comm, rev, out)
    for c in (subsub, sub):  # rev is left to comm.close(); the parent must keep working without them
        c.close()
        c.close()  # idempotent
    comm.barrier()
    for op, tot in sorted(comm.stats.by_op.items()):
        out[f"stats/{op}"] = torch.tensor([tot.calls, tot.bytes_sent, tot.bytes_recv], dtype=torch.int64)
    return out


def _allgather_launches(comm: Communicator, rev: Communicator, out: dict[str, Tensor]) -> None:
    """Launch-time properties of both allgather forms (``rev``: every rank, reversed)."""
    r, n = comm.rank, comm.world_size
    if n > 1:
        _launch_checks(comm, r, out, "launch/world")
        _launch_checks(rev, r, out, "launch/split")
    # Neither form blocks at launch while rank 0 is late (a header round trip would wait for it).
    comm.barrier()
    if r == 0:
        time.sleep(LATE_S)
    t0 = time.perf_counter()
    hs = [comm.allgather_async(torch.full((3,), float(r)), same_shape=True),
          comm.allgather_async(torch.full((r + 1,), float(r))), comm.allgather_async(torch.ones(2 * r, 2))]
    issued = time.perf_counter() - t0
    res = [h.wait() for h in hs]
    out["launch/nonblocking"] = torch.tensor(r == 0 or issued < LATE_S / 2)
    out["launch/nonblocking_result"] = torch.cat([torch.cat([x.reshape(-1) for x in xs]) for xs in res])
    # The same issue order, waits in different orders: even ranks wait the allgather first, odd ones
    # an allreduce issued after it first (which needs the even ranks to have issued it), on the same
    # communicator (its data must still go first) and on another one.
    for name, other in (("same", comm), ("other", rev)):
        g, x = torch.arange(r + 2, dtype=torch.int64) * 3, torch.full((4,), float(r + 1))
        hg = comm.allgather_async(g)
        if r % 2 == 0:
            got_g = hg.wait()
            got_x = other.allreduce(x, "sum")
        else:
            got_x = other.allreduce_async(x, "sum").wait()
            got_g = hg.wait()
        out[f"launch/wait_order/{name}"] = torch.cat([got_x.long(), *got_g])
    # Several outstanding variable and same-shape allgathers, an allreduce among them, waited in reverse.
    mix = [comm.allgather_async(torch.full((r + 1, 2), r, dtype=torch.uint8)),
           comm.allgather_async(torch.full((2, 2), float(r)).half(), same_shape=True),
           comm.allgather_async(torch.full((2 * r + 1,), r, dtype=torch.int32)),
           comm.allreduce_async(torch.full((8,), float(r)), "sum"),
           comm.allgather_async(torch.full((r,), r == 1)),
           comm.allgather_async(torch.full((5,), r, dtype=torch.int64), same_shape=True)]
    res = [h.wait() for h in reversed(mix)][::-1]
    for i, got in enumerate(res):
        for k, t in enumerate([got] if isinstance(got, Tensor) else got):
            out[f"launch/mix/{i}/{k}"] = t


def _bad_alltoall(comm: Communicator, shape: tuple[int, ...]) -> bool:
    """True when alltoall refuses a first dimension that the world size does not divide with a
    ValueError that says so (and, not being a collective, leaves the ranks in step)."""
    try:
        comm.alltoall(torch.zeros(shape))
    except ValueError as e:
        return "multiple of the world size" in str(e)
    return comm.world_size == 1 and len(shape) > 0  # every first dimension is a multiple of 1
