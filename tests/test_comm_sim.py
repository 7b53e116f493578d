"""The ``sim`` backend and the cost formulas every backend accounts with."""

from __future__ import annotations

import threading

import pytest
import torch

from gradzip.comm import SimWorld, cost
from gradzip.errors import CommError, CommTimeout

# ---------------------------------------------------------------- cost formulas, by hand


@pytest.mark.parametrize("n, want", [(1, 0), (2, 1000), (4, 1500)])
def test_allreduce_bytes_ring(n, want):
    # ring: 2(n-1) steps of S/n: n=2 -> 2*1*1000/2, n=4 -> 2*3*1000/4
    assert cost.allreduce_bytes(1000, n) == want


def test_allgather_bytes_uneven():
    assert cost.allgather_bytes([123], 0) == (0, 0)
    # n=2, sizes 100/300: rank 0 forwards only its own block, receives rank 1's
    assert cost.allgather_bytes([100, 300], 0) == (100, 300)
    assert cost.allgather_bytes([100, 300], 1) == (300, 100)
    # n=4, total 100: rank r sends everything but its successor's block, receives all but its own
    sizes = [10, 20, 30, 40]
    assert [cost.allgather_bytes(sizes, r) for r in range(4)] == [(80, 90), (70, 80), (60, 70), (90, 60)]


def test_broadcast_bytes_chain():
    assert cost.broadcast_bytes(64, 1, 0, 0) == (0, 0)
    assert [cost.broadcast_bytes(64, 2, r, 0) for r in range(2)] == [(64, 0), (0, 64)]
    # n=4 rooted at 1: chain 1 -> 2 -> 3 -> 0
    assert [cost.broadcast_bytes(64, 4, r, 1) for r in range(4)] == [(0, 64), (64, 0), (64, 64), (64, 64)]


def test_alpha_beta_times():
    link = cost.Link(1e9, 50e-6)
    assert cost.allreduce_time(1e6, 1, link) == 0.0
    assert cost.allreduce_time(1e6, 4, link) == pytest.approx(6 * 50e-6 + 1.5e6 * 8 / 1e9)
    assert cost.allgather_time([100, 300], link) == pytest.approx(50e-6 + 300 * 8 / 1e9)
    assert cost.broadcast_time(1e6, 4, link) == pytest.approx(3 * 50e-6 + 8e6 / 1e9)
    assert cost.barrier_time(4, link) == pytest.approx(6 * 50e-6)
    # with one GPU per node the hierarchical formula is the flat ring
    assert cost.hierarchical_allreduce_time(1e6, 4, 1, link, link) == pytest.approx(cost.allreduce_time(1e6, 4, link))


# ---------------------------------------------------------------- sim collectives

def _launch_all(world, fn):
    handles = [fn(c) for c in world]
    return [h.wait() for h in handles]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_allreduce_sum_mean_exact(n):
    world = SimWorld(n)
    xs = [torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1) for r in range(n)]
    ts = [x.clone() for x in xs]
    out = _launch_all(world, lambda c: c.allreduce_async(ts[c.rank], "sum"))
    want = sum(xs)
    for r in range(n):
        assert out[r] is ts[r]  # in place
        assert torch.equal(ts[r], want)
    ts = [x.clone() for x in xs]
    _launch_all(world, lambda c: c.allreduce_async(ts[c.rank], "mean"))
    assert all(torch.equal(t, want / n) for t in ts)


def test_allreduce_keeps_dtype_and_sums_in_fp32():
    world = SimWorld(4)
    # 1 + 3 * 2^-8: summed in bf16 step by step every addition rounds back to 1.0; in fp32 the
    # sum is 1.01171875, which rounds (ties to even) to bf16 1.015625.
    ts = [torch.full((3,), 1.0 if r == 0 else 2.0**-8, dtype=torch.bfloat16) for r in range(4)]
    _launch_all(world, lambda c: c.allreduce_async(ts[c.rank], "sum"))
    assert ts[0].dtype == torch.bfloat16
    assert ts[0].tolist() == [1.015625] * 3
    ints = [torch.tensor([1, -7, 9], dtype=torch.int32) for _ in range(2)]
    ints[1] += 2
    _launch_all(SimWorld(2), lambda c: c.allreduce_async(ints[c.rank], "mean"))
    assert ints[0].tolist() == [2, -6, 10]  # (1+3)/2, (-7-5)/2, (9+11)/2


def test_allgather_different_shapes_and_dtypes():
    world = SimWorld(3)
    f = [torch.randn(r + 1, 2) for r in range(3)]
    u = [torch.randint(0, 256, (4 * r,), dtype=torch.uint8) for r in range(3)]  # rank 0 sends nothing
    outs_f = _launch_all(world, lambda c: c.allgather_async(f[c.rank]))
    outs_u = _launch_all(world, lambda c: c.allgather_async(u[c.rank]))
    for r in range(3):
        assert [t.shape for t in outs_f[r]] == [(1, 2), (2, 2), (3, 2)]
        assert all(torch.equal(a, b) for a, b in zip(outs_f[r], f))
        assert [t.dtype for t in outs_u[r]] == [torch.uint8] * 3
        assert all(torch.equal(a, b) for a, b in zip(outs_u[r], u))
    outs_f[0][1].add_(1)  # results are copies: one rank's result does not alias another's
    assert torch.equal(outs_f[1][1], f[1])


def test_broadcast_from_any_root():
    world = SimWorld(4)
    ts = [torch.full((5,), float(r)) for r in range(4)]
    _launch_all(world, lambda c: c.broadcast_async(ts[c.rank], src=2))
    assert all(torch.equal(t, torch.full((5,), 2.0)) for t in ts)
    with pytest.raises(ValueError, match="out of range"):
        world[0].broadcast_async(ts[0], src=4)


def test_byte_accounting_matches_formulas():
    n = 4
    world = SimWorld(n)
    ts = [torch.zeros(250) for _ in range(n)]  # 1000 bytes
    _launch_all(world, lambda c: c.allreduce_async(ts[c.rank]))
    gs = [torch.zeros(r + 1, dtype=torch.float64) for r in range(n)]  # 8, 16, 24, 32 bytes
    _launch_all(world, lambda c: c.allgather_async(gs[c.rank]))
    bs = [torch.zeros(16, dtype=torch.uint8) for _ in range(n)]
    _launch_all(world, lambda c: c.broadcast_async(bs[c.rank], src=0))
    for c in world:
        c.barrier()
    ag = {0: (64, 72), 1: (56, 64), 2: (48, 56), 3: (72, 48)}  # total 80: (80 - s[r+1], 80 - s[r])
    bc = {0: (16, 0), 1: (16, 16), 2: (16, 16), 3: (0, 16)}
    for c in world:
        by = c.stats.by_op
        assert (by["allreduce"].bytes_sent, by["allreduce"].bytes_recv) == (1500, 1500)
        assert (by["allgather"].bytes_sent, by["allgather"].bytes_recv) == ag[c.rank]
        assert (by["broadcast"].bytes_sent, by["broadcast"].bytes_recv) == bc[c.rank]
        assert (by["barrier"].calls, by["barrier"].bytes_sent) == (1, 0)
        assert c.stats.calls == 4
        assert c.stats.bytes_sent == 1500 + ag[c.rank][0] + bc[c.rank][0]


def test_modelled_time_on_handles_and_stats():
    world = SimWorld(4, bandwidth="100mbit", latency="1ms")
    ts = [torch.zeros(25_000) for _ in range(4)]  # 100 kB
    hs = [c.allreduce_async(ts[c.rank]) for c in world]
    for h in hs:
        h.wait()
    want = 6 * 1e-3 + 1.5 * 100_000 * 8 / 100e6
    assert hs[0].modelled_s == pytest.approx(want)
    assert world[3].stats.seconds == pytest.approx(want)
    assert world[0].clock == "modelled"


def test_stats_snapshot_since_and_reset():
    world = SimWorld(2)
    snap = world[0].stats.snapshot()
    ts = [torch.zeros(10) for _ in range(2)]
    _launch_all(world, lambda c: c.allreduce_async(ts[c.rank]))
    d = world[0].stats.since(snap)
    assert d["bytes_sent"] == 40 and d["calls"] == 1
    world[0].stats.reset()
    assert world[0].stats.bytes_sent == 0 and not world[0].stats.by_op


def test_mismatched_collectives_are_an_error():
    world = SimWorld(2)
    world[0].allreduce_async(torch.zeros(3), "sum")
    with pytest.raises(CommError, match="mismatch"):
        world[1].allgather_async(torch.zeros(3))
    world = SimWorld(2)
    world[0].allreduce_async(torch.zeros(3), "sum")
    with pytest.raises(CommError, match="mismatch"):
        world[1].allreduce_async(torch.zeros(3), "mean")


def test_wait_before_everyone_launched_names_missing_ranks():
    world = SimWorld(4)
    h = world[0].allreduce_async(torch.zeros(3))
    world[2].allreduce_async(torch.zeros(3))
    with pytest.raises(CommError, match=r"rank\(s\) \[1, 3\]"):
        h.wait()


def test_bad_reduce_op():
    with pytest.raises(ValueError, match="sum.*mean"):
        SimWorld(2)[0].allreduce_async(torch.zeros(1), "max")


def test_threaded_mode_runs_collectives_across_threads():
    world = SimWorld(3, threaded=True, timeout=30)
    results = [None] * 3

    def work(r):
        t = torch.full((4,), float(r))
        world[r].allreduce(t, "sum")
        g = world[r].allgather(torch.ones(r + 1))
        world[r].barrier()
        results[r] = (t, [x.numel() for x in g])

    ths = [threading.Thread(target=work, args=(r,)) for r in range(3)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=30)
    assert all(res is not None for res in results)
    for t, sizes in results:
        assert torch.equal(t, torch.full((4,), 3.0)) and sizes == [1, 2, 3]


def test_threaded_mode_timeout_names_lost_rank():
    world = SimWorld(3, threaded=True, timeout=0.2)
    errors = {}

    def work(r):
        try:
            world[r].allreduce(torch.zeros(2))
        except CommTimeout as e:
            errors[r] = str(e)

    ths = [threading.Thread(target=work, args=(r,)) for r in (0, 2)]  # rank 1 never comes
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=30)
    assert set(errors) == {0, 2}
    assert all("lost rank(s) [1]" in m and "allreduce" in m for m in errors.values())


def test_world_of_one_and_bad_size():
    world = SimWorld(1)
    t = torch.randn(5)
    want = t.clone()
    world[0].allreduce(t, "mean")
    assert torch.equal(t, want)
    assert world[0].stats.bytes_sent == 0
    with pytest.raises(ValueError, match=">= 1"):
        SimWorld(0)


# ---------------------------------------------------------------- alltoall, split, two link levels
def _all(handles):
    return [h.wait() for h in handles]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.bool, torch.int64])
def test_alltoall_sends_chunk_j_to_rank_j(dtype):
    n = 4
    world = SimWorld(n)
    ins = [(torch.arange(n * 3 * 2).reshape(n * 3, 2) + 100 * r).to(dtype) for r in range(n)]
    outs = _all([c.alltoall_async(t) for c, t in zip(world, ins)])
    for r in range(n):
        assert outs[r].shape == ins[r].shape and outs[r].dtype == dtype
        for i in range(n):
            assert torch.equal(outs[r][3 * i:3 * i + 3], ins[i][3 * r:3 * r + 3])
    size = ins[0].numel() * ins[0].element_size()
    assert world[0].stats.by_op["alltoall"].bytes_sent == cost.alltoall_bytes(size, n) == 3 * size // 4
    with pytest.raises(ValueError, match="multiple of the world size 4"):
        world[0].alltoall_async(torch.zeros(6))


def test_split_groups_ranks_by_colour_and_key_and_shares_the_stats():
    world = SimWorld(6)
    subs = [c.split(c.rank % 2, key=-c.rank) for c in world]
    with pytest.raises(CommError, match="not every worker"):
        SimWorld(2)[0].split(0).rank  # noqa: B018 - the other worker never called split
    assert [(s.rank, s.world_size) for s in subs] == [(2, 3), (2, 3), (1, 3), (1, 3), (0, 3), (0, 3)]
    assert subs[4].world.members == [4, 2, 0]
    before = world[0].stats.bytes_sent
    outs = _all([s.allreduce_async(torch.tensor([float(c.rank)]), "sum") for s, c in zip(subs, world)])
    assert [float(o) for o in outs] == [6.0, 9.0, 6.0, 9.0, 6.0, 9.0]
    assert world[0].stats.bytes_sent > before  # the sub-communicator records into its parent's stats
    subsub = [s.split(0 if s.rank == 0 else 1) for s in subs]
    assert [x.world_size for x in subsub] == [2, 2, 2, 2, 1, 1]


def test_two_link_levels_and_a_shared_network_card():
    world = SimWorld(8, bandwidth="1gbit", latency="50us", ranks_per_node=4, intra_bandwidth="100gbit",
                     intra_latency="5us")
    node = [c.split(c.rank // 4) for c in world]
    cross = [c.split(c.rank % 4) for c in world]
    intra, inter = node[5].world.link, cross[0].world.link
    assert (intra.bandwidth_bps, intra.latency_s) == (1e11, pytest.approx(5e-6))  # inside a node
    # four cross-node groups (one per local rank) go through each node's one card at once
    assert cross[0].world.share == 4 and (inter.bandwidth_bps, inter.latency_s) == (1e9 / 4, pytest.approx(50e-6))
    hs = [c.allreduce_async(torch.zeros(1000)) for c in node]
    _all(hs)
    assert hs[0].modelled_s == pytest.approx(cost.allreduce_time(4000, 4, intra))
    hs = [c.alltoall_async(torch.zeros(8000, dtype=torch.uint8)) for c in world]
    _all(hs)
    want = cost.Link(1e9, 50e-6).transfer(4 * 4 / 8 * 8000, 4) + cost.Link(1e11, 5e-6).transfer(3 / 8 * 8000, 3)
    assert hs[0].modelled_s == pytest.approx(want)


# ---------------------------------------------------------------- allgather(same_shape=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.bool, torch.int64])
def test_same_shape_allgather_matches_the_variable_one_in_results_bytes_and_ops(dtype):
    n = 4
    ins = [(torch.arange(6).reshape(2, 3) + 10 * r).to(dtype) for r in range(n)]
    var, same = SimWorld(n), SimWorld(n)
    want = _all([c.allgather_async(ins[c.rank]) for c in var])
    got = _all([c.allgather_async(ins[c.rank], same_shape=True) for c in same])
    for r in range(n):
        assert [t.dtype for t in got[r]] == [dtype] * n and [t.shape for t in got[r]] == [(2, 3)] * n
        assert all(torch.equal(a, b) for a, b in zip(got[r], want[r]))
        assert all(torch.equal(a, b) for a, b in zip(got[r], ins))
        v, s = var[r].stats.by_op["allgather"], same[r].stats.by_op["allgather"]
        assert (s.calls, s.bytes_sent, s.bytes_recv) == (v.calls, v.bytes_sent, v.bytes_recv) == \
            (1, *cost.allgather_bytes([ins[0].numel() * ins[0].element_size()] * n, r))
        assert same[r]._seq == 1 and same[r].stats.calls == 1  # one op, nothing else


def test_same_shape_allgather_in_a_split_and_the_sync_form():
    world = SimWorld(4, threaded=True, timeout=30)
    out = [None] * 4

    def work(r):
        sub = world[r].split(r % 2, key=-r)
        out[r] = (sub.allgather(torch.full((2,), float(r)), same_shape=True), world[r].allgather(
            torch.tensor(r), same_shape=True))

    ths = [threading.Thread(target=work, args=(r,)) for r in range(4)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=30)
    for r in range(4):
        sub_res, world_res = out[r]
        members = [3, 1] if r % 2 else [2, 0]  # key = -rank: reversed
        assert [t.tolist() for t in sub_res] == [[float(m)] * 2 for m in members]
        assert [int(t) for t in world_res] == [0, 1, 2, 3] and world_res[0].shape == ()


@pytest.mark.parametrize("threaded", [False, True])
def test_broken_same_shape_promise_is_a_clear_error_on_every_rank(threaded):
    n = 4
    world = SimWorld(n, threaded=threaded, timeout=30)
    ins = [torch.zeros(3), torch.zeros(3), torch.zeros(5), torch.zeros(3, dtype=torch.float64)]
    errors: dict[int, str] = {}
    if threaded:
        def work(r):
            try:
                world[r].allgather(ins[r], same_shape=True)
            except CommError as e:
                errors[r] = str(e)

        ths = [threading.Thread(target=work, args=(r,)) for r in range(n)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(timeout=30)
    else:
        hs = [c.allgather_async(ins[c.rank], same_shape=True) for c in world]
        for r, h in enumerate(hs):
            with pytest.raises(CommError) as e:
                h.wait()
            errors[r] = str(e.value)
    assert sorted(errors) == list(range(n))
    for msg in errors.values():
        assert "same_shape=True" in msg and "rank(s) [2, 3]" in msg, msg  # rank 2: shape, rank 3: dtype
        assert "rank 2: (5,) float32" in msg and "rank 3: (3,) float64" in msg, msg
    assert world[0].stats.calls == 0  # nothing was gathered, nothing counted
    # the world keeps working afterwards
    hs = [c.allgather_async(torch.ones(2), same_shape=True) for c in world]
    if threaded:
        res = [None] * n
        ths = [threading.Thread(target=lambda r: res.__setitem__(r, hs[r].wait()), args=(r,)) for r in range(n)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(timeout=30)
    else:
        res = _all(hs)
    assert all(len(x) == n for x in res)


def test_broken_same_shape_promise_names_the_odd_rank_even_if_it_is_rank_0():
    world = SimWorld(3)
    hs = [c.allgather_async(torch.zeros(2 if c.rank == 0 else 4), same_shape=True) for c in world]
    with pytest.raises(CommError, match=r"rank\(s\) \[0\] passed a different shape"):
        hs[1].wait()


def test_same_shape_must_be_the_same_on_every_rank():
    world = SimWorld(2)
    world[0].allgather_async(torch.zeros(3), same_shape=True)
    with pytest.raises(CommError, match=r"allgather\(same_shape=False\).*allgather\(same_shape=True\)"):
        world[1].allgather_async(torch.zeros(3))


def test_slow_link_forwards_same_shape():
    from gradzip.bench.engine import SlowLink

    world = SimWorld(2)
    slow = [SlowLink(c, cost.Link(1e12, 0.0)) for c in world]
    hs = [s.allgather_async(torch.zeros(1 + s.rank), same_shape=True) for s in slow]
    with pytest.raises(CommError, match="same_shape=True"):  # the promise reached sim, which checks it
        hs[0].wait()
    hs = [s.allgather_async(torch.full((2,), float(s.rank)), same_shape=True) for s in slow]
    assert [t.tolist() for t in hs[1].wait()] == [[0.0, 0.0], [1.0, 1.0]]


# ---------------------------------------------------------------- deferred launches (torch and mpi)
def test_deferred_launches_run_in_issue_order_and_keep_their_errors():
    from gradzip.comm import _common

    order: list[str] = []
    ready = {"a": False, "b": True, "c": True}

    def item(name, fail=False):
        def launch():
            order.append(name)
            if fail:
                raise CommError(f"{name} failed")
        return _common.defer_launch(launch, lambda: ready[name], owner=name)

    a, b, c = item("a"), item("b", fail=True), item("c")
    _common.progress_launches()  # a's header is not back: nothing may overtake it
    assert order == [] and _common.pending_launches() == 3
    ready["a"] = True
    _common.progress_launches()
    assert order == ["a", "b", "c"] and a.done and b.done and c.done
    assert a.error is None and isinstance(b.error, CommError) and c.error is None  # a failure stops nothing else
    d, e = item("a"), item("c")
    _common.drop_launches("a", "closed")  # a closing communicator takes its own launches out
    assert d.done and str(d.error) == "closed" and _common.pending_launches() == 1
    ready["c"] = False
    _common.flush_launches()  # flush launches even what is not ready (the launch itself waits)
    assert order[-1] == "c" and e.done and _common.pending_launches() == 0
