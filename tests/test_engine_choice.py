"""A compressor per bucket (gradzip.engine.choice.ChoiceEngine): the auto policy's actuator.

The error-feedback invariant across switches, checked on a linear model whose gradients are known:
over any run, the averaged gradients the optimizer got plus the workers' mean memory equal the sum
of the workers' mean gradients, whichever candidates the buckets moved through (those with error
feedback, PowerSGD's own, and none; fp16's rounding is no residual, so it stays out of the plan)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradzip.comm.sim import SimWorld
from gradzip.engine.choice import ChoiceEngine
from gradzip.engine.config import EngineConfig
from gradzip.errors import GradzipError

CANDIDATES = ("none", "topk:ratio=0.1,ef=true", "onebit:ef=true", "fp16", "powersgd:rank=1")
N = 3


def linear_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 30, bias=False), nn.Linear(30, 20, bias=False))


def grads_of(step: int, w: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + w)
    return [torch.randn(30, 40, generator=g), torch.randn(20, 30, generator=g)]


def step(engine: ChoiceEngine, model: nn.Module, s: int, nan_on: int | None = None) -> list[torch.Tensor]:
    """Every worker's backward writes its known gradient; returns the averaged gradients."""
    params = list(model.parameters())
    for w in engine.worker_ids:
        with engine.worker(w):
            gs = grads_of(s, w)
            if nan_on == w:
                gs[0][0, 0] = float("nan")
            loss = sum((p * g).sum() for p, g in zip(params, gs))
            loss.backward()
    stats = engine.finalize()
    if stats.nonfinite:
        engine.skip_step()
        return [torch.zeros_like(p) for p in params]
    return [p.grad.clone() for p in params]


def engine_for(model: nn.Module, hierarchical: bool = False) -> ChoiceEngine:
    # buckets of one matrix each (a 5 KiB cap), both compressed; hierarchical: 2 nodes of 2 workers
    world = SimWorld(4, ranks_per_node=2) if hierarchical else SimWorld(N)
    return ChoiceEngine(model, CANDIDATES, world, EngineConfig(bucket_cap_mb=5e-3, min_compress_numel=16,
                                                               hierarchical=hierarchical))


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hierarchical"])
def test_switching_keeps_every_residual_once(hierarchical):
    model = linear_model()
    engine = engine_for(model, hierarchical)
    n = len(engine.worker_ids)
    assert len(engine.buckets) == 2 and all(b.compressed for b in engine.buckets)
    plan = [("topk:ratio=0.1,ef=true", "onebit:ef=true"), ("topk:ratio=0.1,ef=true", "topk:ratio=0.1,ef=true"),
            ("none", "none"), ("onebit:ef=true", "topk:ratio=0.1,ef=true"), ("powersgd:rank=1", "none"),
            ("topk:ratio=0.1,ef=true", "onebit:ef=true"), ("none", "powersgd:rank=1")]
    applied = [torch.zeros(30, 40), torch.zeros(20, 30)]
    truth = [torch.zeros(30, 40), torch.zeros(20, 30)]
    s = 0
    for choice in plan:
        for i, spec in enumerate(choice):
            engine.assign(i, spec)
        for _ in range(2):
            s += 1
            got = step(engine, model, s, nan_on=1 if s == 5 else None)  # step 5 skipped everywhere
            if s == 5:
                continue
            for a, g in zip(applied, got):
                a += g
            for t, k in zip(truth, range(2)):
                t += sum(grads_of(s, w)[k] for w in range(n)) / n
        # the invariant after every pair of steps: applied + mean memory == sum of mean gradients
        by_bucket = {tuple(b.shapes[0]): b.index for b in engine.buckets}
        for k, shape in enumerate([(30, 40), (20, 30)]):
            bi = by_bucket[shape]
            mem = sum(engine.memory(w, bi) for w in engine.worker_ids) / n
            torch.testing.assert_close(applied[k] + mem.view(shape), truth[k], atol=2e-5, rtol=1e-5)
    assert engine.assigned == [engine.assigned[0], engine.assigned[1]]


def test_a_skipped_step_puts_the_moved_residual_back():
    model = linear_model()
    engine = engine_for(model)
    for i in range(2):
        engine.assign(i, "topk:ratio=0.1,ef=true")
    step(engine, model, 1)
    before = [engine.memory(w, 0).clone() for w in engine.worker_ids]
    assert any(m.abs().sum() > 0 for m in before)
    engine.assign(0, "none")  # the memory now waits for bucket 0's next gradient
    assert all(torch.equal(engine.memory(w, 0), m) for w, m in zip(engine.worker_ids, before))
    step(engine, model, 2, nan_on=0)  # skipped: the residual it took is put back
    assert all(torch.equal(engine.memory(w, 0), m) for w, m in zip(engine.worker_ids, before))
    step(engine, model, 3)  # sent in full under none: nothing left
    assert all(engine.memory(w, 0).abs().sum() == 0 for w in engine.worker_ids)


def test_state_round_trips_with_the_choice_and_pending_residuals():
    model = linear_model()
    engine = engine_for(model)
    engine.assign(0, "onebit:ef=true")
    engine.assign(1, "topk:ratio=0.1,ef=true")
    step(engine, model, 1)
    engine.assign(1, "fp16")
    sd = engine.state_dict()
    other = engine_for(linear_model())
    other.load_state_dict(sd)
    assert other.assigned == engine.assigned
    for w in engine.worker_ids:
        for i in range(2):
            torch.testing.assert_close(other.memory(w, i), engine.memory(w, i))


def test_bad_use_is_one_line():
    model = linear_model()
    with pytest.raises(GradzipError, match="twophase keeps server memory"):
        ChoiceEngine(model, ("none", "onebit:exchange=twophase"), SimWorld(2))
    engine = ChoiceEngine(linear_model(), ("none", "fp16"), SimWorld(2))
    with pytest.raises(GradzipError, match="not one of the candidates"):
        engine.assign(0, "onebit")
