"""Exchange schemes on the sim backend: the twophase compressed allreduce (both error memories,
bytes flat in n, resume) and the spelling of ``exchange=`` (generic over the registry: a new
compressor that declares a scheme is covered without edits). Gloo/MPI equality with sim is in
tests/test_engine_dist.py."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from test_engine import Net, data, manual_mean_grads, run_step, sgd_step

from gradzip.comm.sim import SimWorld
from gradzip.compress import create, registry
from gradzip.compress.base import Compressor
from gradzip.engine import attach
from gradzip.engine.schemes import SchemeState, TwoPhaseExchange
from gradzip.errors import SpecError


def scheme_specs(scheme: str) -> list[str]:
    """``name:exchange=scheme`` for every registered compressor that declares ``scheme``."""
    return [f"{name}:exchange={scheme}" for name, cls in registry().items() if scheme in cls.schemes]


TWOPHASE = scheme_specs("twophase")
# Compressors whose ranks' decoded payloads combine by the mean (signSGD votes instead).
MEAN_TWOPHASE = [s for s in TWOPHASE if type(create(s)).aggregate is Compressor.aggregate]


def run_exchange(specs: list[str], grads: list[torch.Tensor], states=None, comps=None, world=None):
    n = len(grads)
    world = world or SimWorld(n)
    comps = comps or [create(s) for s in specs]
    states = states or [SchemeState(c, cm) for c, cm in zip(comps, world)]
    exs = [s.exchange(c, [g], "b0") for s, c, g in zip(states, comps, grads)]
    for e in exs:
        e.start()
    done = [False] * n
    while not all(done):
        done = [e.advance() for e in exs]
    return [e.result()[0] for e in exs], comps, states, exs


def test_twophase_is_declared_by_the_element_wise_compressors():
    names = {s.split(":")[0] for s in TWOPHASE}
    assert {"onebit", "signsgd", "topk", "randomk", "fp16", "bf16"} <= names
    assert "powersgd" not in names and "none" not in names


@pytest.mark.parametrize("spec", MEAN_TWOPHASE)
@pytest.mark.parametrize("n", [2, 3, 5])
def test_twophase_keeps_both_error_memories_exact(spec, n):
    """result = mean over ranks of (g + worker memory before − after) + server memory before − after,
    elementwise, for every rank's shard: nothing is lost between the two compressions."""
    spec = f"{spec},ef=true"
    g = torch.Generator().manual_seed(n)
    numel = 101  # not a multiple of n: the last chunk is padded
    comps = states = None
    world = SimWorld(n)
    for step in range(3):
        grads = [torch.randn(numel, generator=g) for _ in range(n)]
        before_w = [_memory(c, n, numel) for c in comps] if comps else [torch.zeros(numel)] * n
        before_s = _server_memory(states, n, numel) if states else torch.zeros(numel)
        outs, comps, states, exs = run_exchange([spec] * n, grads, states, comps, world)
        assert isinstance(exs[0], TwoPhaseExchange)
        after_w = [_memory(c, n, numel) for c in comps]
        after_s = _server_memory(states, n, numel)
        expected = sum(gr + b - a for gr, b, a in zip(grads, before_w, after_w)) / n + before_s - after_s
        for r in range(n):
            torch.testing.assert_close(outs[r], outs[0], rtol=0, atol=0)  # every rank gets the same
        torch.testing.assert_close(outs[0], expected, rtol=1e-5, atol=1e-5, msg=f"{spec} n={n} step {step}")


def _memory(comp, n: int, numel: int) -> torch.Tensor:
    """A rank's worker memory over the bucket (its n chunk memories, padding dropped)."""
    return torch.cat([comp.memory[f"b0/{j}"][0] for j in range(n)])[:numel]


def _server_memory(states, n: int, numel: int) -> torch.Tensor:
    """Every rank's server memory of its own shard, in shard order."""
    return torch.cat([s.server.memory["b0/server"][0] for s in states])[:numel]


@pytest.mark.parametrize("spec", ["fp16:exchange=twophase", "bf16:exchange=twophase"])
def test_twophase_of_a_cast_is_the_mean_to_the_casts_precision(spec):
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(1000, generator=g) for _ in range(4)]
    outs, *_ = run_exchange([spec] * 4, grads)
    tol = 2e-3 if spec.startswith("fp16") else 2e-2
    torch.testing.assert_close(outs[0], sum(grads) / 4, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["onebit", "topk:ratio=0.01,ef=true"])
def test_twophase_bytes_stay_flat_while_allgather_grows(name):
    """Per-rank bytes per step against n: twophase within 2.2x the payload at every n (exactly
    2(n-1) chunk payloads), allgather (n-1) payloads."""
    model = torch.nn.Linear(256, 256, bias=False)  # 256 KiB, one bucket
    payload = create(name).payload_bytes((256 * 256,))
    sep = "," if ":" in name else ":"
    flat, gathered = {}, {}
    for n in (2, 4, 8, 16, 32):
        batches = [(torch.randn(2, 256), torch.randn(2, 256))] * n
        for spec, out in ((f"{name}{sep}exchange=twophase", flat), (name, gathered)):
            engine = attach(model, spec, SimWorld(n), min_compress_numel=0)
            out[n] = run_step(engine, model, batches).bytes_sent
            engine.detach()
        chunk = create(name).payload_bytes((math.ceil(256 * 256 / n),))
        assert flat[n] == 2 * (n - 1) * chunk
        assert flat[n] <= 2.2 * payload, (n, flat[n], payload)
        assert gathered[n] == (n - 1) * payload
    assert gathered[32] / gathered[2] > 25 and flat[32] / flat[2] < 2.1


@pytest.mark.parametrize("spec", TWOPHASE)
def test_every_twophase_compressor_trains_through_the_engine(spec):
    torch.manual_seed(4)
    model = Net()
    engine = attach(model, spec, SimWorld(3), bucket_cap_mb=0.002, min_compress_numel=32)
    for step in range(3):
        run_step(engine, model, data(3, step))
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        sgd_step(model)
    if spec.startswith(("fp16", "bf16")):  # near-lossless: the mean
        run_step(engine, model, data(3, 9))
        for p, e in zip(model.parameters(), manual_mean_grads(model, data(3, 9))):
            torch.testing.assert_close(p.grad, e, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("spec", ["onebit:exchange=twophase", "topk:ratio=0.1,ef=true,exchange=twophase",
                                  "randomk:ratio=0.2,unbiased=false,ef=true,exchange=twophase"])
def test_twophase_resume_is_bit_identical(spec):
    torch.manual_seed(6)
    model = Net()
    twin = copy.deepcopy(model)
    kw = dict(bucket_cap_mb=0.002, min_compress_numel=32)
    engine = attach(model, spec, SimWorld(3), **kw)
    for step in range(2):
        run_step(engine, model, data(3, step))
        sgd_step(model)
    state = engine.state_dict()
    assert any(s["server"] for s in state["schemes"]), "the server memory is checkpointed"
    buf = io.BytesIO()
    torch.save({"engine": state, "model": model.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    twin.load_state_dict(saved["model"])
    engine2 = attach(twin, spec, SimWorld(3), **kw)
    engine2.load_state_dict(saved["engine"])
    for step in (2, 3):
        run_step(engine, model, data(3, step))
        run_step(engine2, twin, data(3, step))
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
        sgd_step(model)
        sgd_step(twin)


def test_exchange_spelling_round_trips_and_bad_spellings_are_one_line():
    c = create("onebit:exchange=twophase")
    assert c.exchange == "twophase" and c.spec == "onebit:ef=true,exchange=twophase"
    assert create(c.spec).spec == c.spec
    assert create("onebit").exchange == "allgather" and "exchange" not in create("onebit").spec
    with pytest.raises(SpecError, match=r"unknown exchange scheme 'bogus'; onebit supports exchange=allgather\|two"):
        create("onebit:exchange=bogus")
    with pytest.raises(SpecError, match=r"powersgd does not support exchange 'twophase'; .*exchange=allreduce$"):
        create("powersgd:exchange=twophase")
    with pytest.raises(SpecError, match="valid parameters: ratio, ef, exchange"):
        create("topk:exchnage=twophase")


def test_one_worker_needs_no_exchange():
    outs, *_ = run_exchange(["onebit:exchange=twophase,ef=false"], [torch.tensor([1.0, -2.0, 3.0])])
    torch.testing.assert_close(outs[0], torch.full((3,), 2.0) * torch.tensor([1.0, -1.0, 1.0]))


# ------------------------------------------------------------------ sparse (gTop-k)
SPARSE = scheme_specs("sparse")


def test_sparse_is_declared_by_top_k():
    assert [s.split(":")[0] for s in SPARSE] == ["topk"]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_sparse_keeps_k_entries_the_same_on_every_rank_and_the_error_memory_exact(n):
    """Every rank gets the same k entries; Σ_r (g_r + m_r − m_r') = n · result (whatever a merge
    drops is kept in exactly one memory)."""
    spec = "topk:ratio=0.1,ef=true,exchange=sparse"
    g = torch.Generator().manual_seed(n)
    world = SimWorld(n)
    comps = states = None
    for step in range(3):
        grads = [torch.randn(101, generator=g) for _ in range(n)]
        before = [c.memory["b0"][0].clone() for c in comps] if comps else [torch.zeros(101)] * n
        outs, comps, states, _ = run_exchange([spec] * n, grads, states, comps, world)
        after = [c.memory["b0"][0] for c in comps]
        for r in range(n):
            torch.testing.assert_close(outs[r], outs[0], rtol=0, atol=0)
        assert int((outs[0] != 0).sum()) == 11  # k = ceil(0.1 * 101)
        expected = sum(gr + b - a for gr, b, a in zip(grads, before, after)) / n
        torch.testing.assert_close(outs[0], expected, rtol=1e-5, atol=1e-6, msg=f"n={n} step {step}")


def test_sparse_on_two_ranks_is_the_top_k_of_the_summed_selections():
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(200, generator=g) for _ in range(2)]
    outs, *_ = run_exchange(["topk:ratio=0.05,exchange=sparse"] * 2, grads)
    sel = []
    for x in grads:
        i = x.abs().topk(10).indices
        sel.append(torch.zeros(200).index_copy_(0, i, x[i]))
    total = sel[0] + sel[1]
    keep = total.abs().topk(10).indices
    expected = torch.zeros(200).index_copy_(0, keep, total[keep] / 2)
    torch.testing.assert_close(outs[0], expected)


def test_sparse_bytes_grow_with_log_n_not_n():
    model = torch.nn.Linear(256, 256, bias=False)
    k = math.ceil(0.01 * 256 * 256)
    sent = {}
    for n in (2, 4, 8, 16, 32):
        engine = attach(model, "topk:ratio=0.01,ef=true,exchange=sparse", SimWorld(n), min_compress_numel=0)
        sent[n] = run_step(engine, model, [(torch.randn(2, 256), torch.randn(2, 256))] * n).bytes_sent
        engine.detach()
        assert sent[n] == 8 * k * int(math.log2(n))  # fp32 value + int32 index per entry and level
    assert sent[32] == 5 * sent[2]


def test_sparse_resume_is_bit_identical_and_trains():
    torch.manual_seed(7)
    model = Net()
    twin = copy.deepcopy(model)
    spec = "topk:ratio=0.1,ef=true,exchange=sparse"
    kw = dict(bucket_cap_mb=0.002, min_compress_numel=32)
    engine = attach(model, spec, SimWorld(5), **kw)
    for step in range(2):
        run_step(engine, model, data(5, step))
        sgd_step(model)
    twin.load_state_dict(model.state_dict())
    engine2 = attach(twin, spec, SimWorld(5), **kw)
    engine2.load_state_dict(engine.state_dict())
    for step in (2, 3):
        run_step(engine, model, data(5, step))
        run_step(engine2, twin, data(5, step))
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
            assert torch.isfinite(a.grad).all()
        sgd_step(model)
        sgd_step(twin)


@pytest.mark.parametrize("spec, hierarchical", [("onebit", False), ("onebit:exchange=twophase", False),
                                                ("topk:ratio=0.1,ef=true,exchange=sparse", False),
                                                ("topk:ratio=0.1,ef=true", True)])
def test_fixed_size_payloads_are_gathered_without_a_size_exchange(monkeypatch, spec, hierarchical):
    """Every allgather of a step promises same_shape (the real backends then send no header)."""
    from gradzip.comm.sim import SimCommunicator

    seen = []
    real = SimCommunicator.allgather_async

    def spy(self, tensor, same_shape=False):
        seen.append(same_shape)
        return real(self, tensor, same_shape=same_shape)

    model = Net()
    world = SimWorld(4, ranks_per_node=2)
    engine = attach(model, spec, world, hierarchical=hierarchical, bucket_cap_mb=0.002, min_compress_numel=32)
    monkeypatch.setattr(SimCommunicator, "allgather_async", spy)
    run_step(engine, model, data(4))
    assert seen and all(seen), seen
