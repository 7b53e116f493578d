"""The hierarchical exchange on sim (nodes from ``ranks_per_node``) and node membership from the
launcher's environment. Gloo/MPI equality with sim: tests/test_engine_dist.py."""

from __future__ import annotations

import copy

import pytest
import torch
from test_engine import Net, data, manual_mean_grads, run_step, sgd_step

from gradzip.comm import cost
from gradzip.comm.sim import SimWorld
from gradzip.comm.topology import colour_of, node_key
from gradzip.engine import attach
from gradzip.errors import GradzipError

KW = dict(bucket_cap_mb=0.002, min_compress_numel=32)
SPECS = ["none", "fp16", "onebit", "onebit:exchange=twophase", "topk:ratio=0.1,ef=true",
         "topk:ratio=0.1,ef=true,exchange=sparse", "powersgd:rank=2", "randomk:ratio=0.2,exchange=twophase"]


def train(spec: str, world: SimWorld, hierarchical: bool, steps: int = 3, model: Net | None = None, **kw):
    torch.manual_seed(3)
    model = model or Net()
    engine = attach(model, spec, world, hierarchical=hierarchical, **KW, **kw)
    out = []
    for step in range(steps):
        st = run_step(engine, model, data(world.n, step))
        out.append(([p.grad.clone() for p in model.parameters()], st))
        sgd_step(model)
    return out, engine, model


@pytest.mark.parametrize("spec", SPECS)
def test_one_rank_per_node_is_the_flat_exchange(spec):
    flat, _, _ = train(spec, SimWorld(4), hierarchical=False)
    hier, _, _ = train(spec, SimWorld(4, ranks_per_node=1), hierarchical=True)
    for (ga, sa), (gb, sb) in zip(flat, hier):
        for a, b in zip(ga, gb):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert sa.bytes_sent == sb.bytes_sent


@pytest.mark.parametrize("spec", ["none", "fp16"])
def test_lossless_inner_exchange_gives_the_mean(spec):
    for n, per in ((8, 4), (6, 2), (4, 4)):
        torch.manual_seed(0)
        model = Net()
        engine = attach(model, spec, SimWorld(n, ranks_per_node=per), hierarchical=True, **KW)
        run_step(engine, model, data(n, 1))
        tol = dict(rtol=1e-5, atol=1e-6) if spec == "none" else dict(rtol=2e-2, atol=2e-3)
        for p, e in zip(model.parameters(), manual_mean_grads(model, data(n, 1))):
            torch.testing.assert_close(p.grad, e, **tol)


@pytest.mark.parametrize("spec", SPECS)
def test_every_scheme_trains_hierarchically_and_resumes_bit_identical(spec):
    world = SimWorld(8, ranks_per_node=4)
    out, engine, model = train(spec, world, hierarchical=True, steps=2)
    assert all(torch.isfinite(g).all() for g in out[-1][0])
    twin = copy.deepcopy(model)
    engine2 = attach(twin, spec, SimWorld(8, ranks_per_node=4), hierarchical=True, **KW)
    engine2.load_state_dict(engine.state_dict())
    for step in (2, 3):
        run_step(engine, model, data(8, step))
        run_step(engine2, twin, data(8, step))
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
        sgd_step(model)
        sgd_step(twin)


def test_only_the_shards_cross_nodes_and_the_clock_sees_two_levels():
    """8 workers, 4 per node, one 64 KiB bucket of `none`: per rank, an alltoall and an allgather of
    the bucket inside the node, and a ring allreduce of the 1/4 shard between the 2 nodes."""
    model = torch.nn.Linear(128, 128, bias=False)
    world = SimWorld(8, bandwidth="1gbit", latency="50us", ranks_per_node=4, intra_bandwidth="100gbit",
                     intra_latency="5us")
    engine = attach(model, "none", world, hierarchical=True, min_compress_numel=0)
    st = run_step(engine, model, [(torch.randn(2, 128), torch.randn(2, 128))] * 8)
    size = 128 * 128 * 4
    assert st.bytes_sent == cost.alltoall_bytes(size, 4) + cost.allreduce_bytes(size // 4, 2) + 3 * (size // 4)
    assert st.bytes_sent - st.intra_bytes_sent == cost.allreduce_bytes(size // 4, 2)  # what crossed nodes
    intra, inter = world.intra, cost.Link(world.inter.bandwidth_bps / 4, world.inter.latency_s)  # 4 shards share a card
    want = (cost.alltoall_time(size, 4, intra) + cost.allreduce_time(size / 4, 2, inter)
            + cost.allgather_time([size // 4] * 4, intra))
    assert st.link_s == pytest.approx(want, rel=1e-6)
    assert engine.last_timings[0].rounds_s == pytest.approx([cost.alltoall_time(size, 4, intra),
                                                             cost.allreduce_time(size / 4, 2, inter),
                                                             cost.allgather_time([size // 4] * 4, intra)])


def test_intra_dtype_fp16_halves_the_intra_node_bytes():
    model = torch.nn.Linear(128, 128, bias=False)
    batches = [(torch.randn(2, 128), torch.randn(2, 128))] * 8
    sent = {}
    for dt in ("", "fp16"):
        engine = attach(model, "none", SimWorld(8, ranks_per_node=4), hierarchical=True, min_compress_numel=0,
                        intra_dtype=dt)
        sent[dt] = run_step(engine, model, batches).bytes_sent
        engine.detach()
    size = 128 * 128 * 4
    assert sent[""] - sent["fp16"] == (cost.alltoall_bytes(size, 4) + 3 * (size // 4)) // 2
    with pytest.raises(GradzipError, match="intra_dtype must be one of"):
        attach(model, "none", SimWorld(2), hierarchical=True, intra_dtype="int8")


def test_nodes_of_different_sizes_are_refused():
    with pytest.raises(GradzipError, match="same number of workers on every node"):
        attach(Net(), "none", SimWorld(6, ranks_per_node=4), hierarchical=True)


@pytest.mark.parametrize("env, key, local", [
    ({"GRADZIP_NODE": "h3", "LOCAL_RANK": "1", "GROUP_RANK": "0"}, "GRADZIP_NODE=h3", 1),
    ({"GROUP_RANK": "2", "LOCAL_RANK": "0"}, "GROUP_RANK=2", 0),
    ({"SLURM_NODEID": "5", "SLURM_LOCALID": "3"}, "SLURM_NODEID=5", 3),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, "host=", 2),
    ({}, "host=", None),
])
def test_node_membership_from_the_launcher(env, key, local):
    got, got_local = node_key(env)
    assert got.startswith(key) and got_local == local
    if key == "host=":
        assert "/net" in got  # the network namespace tells the testbed's emulated hosts apart
    assert colour_of(got) == colour_of(got) >= 0 and colour_of("GROUP_RANK=1") != colour_of("GROUP_RANK=2")
