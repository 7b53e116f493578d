"""The one synchronisation protocol (:mod:`gradzip.engine.synchronizer`): the per-step engine and
DiLoCo implement it; a loop written against the protocol alone trains with either and gives what
each class's own API gives; the skip decision is the protocol's; ``gradzip train`` has one path."""

from __future__ import annotations

import ast
import contextlib
import inspect
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from gradzip.comm.sim import SimWorld
from gradzip.engine import attach
from gradzip.engine.diloco import DiLoCo
from gradzip.engine.synchronizer import ExchangePlan, ShapesExchange, Synchronizer
from gradzip.optim import DeMo, OneBitAdam

REPO = Path(__file__).resolve().parents[1]


class Stepper:
    """The loop's optimizer step, counting what the synchroniser asked for."""

    def __init__(self, opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
        self.opt, self.params, self.steps, self.skips, self.unclipped = opt, params, 0, 0, 0

    def step(self, clip: bool = True) -> float:
        self.steps += 1
        self.unclipped += not clip
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None]))
        self.opt.step()
        return norm

    def skip(self) -> None:
        self.skips += 1


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + w)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _protocol_loop(sync: Synchronizer, model: nn.Module, stepper: Stepper, steps: int,
                   poison: tuple[int, int] | None = None, accumulation: int = 1) -> list[float]:
    """The loop of the module docstring of gradzip.engine.synchronizer, nothing mode-specific."""
    norms = []
    for step in range(steps):
        for w in sync.worker_ids:
            with sync.worker(w):
                for micro in range(accumulation):
                    x, y = _batch(step * accumulation + micro, w)
                    with contextlib.nullcontext() if micro == accumulation - 1 else sync.no_sync():
                        loss = ((model(x) - y) ** 2).mean() / accumulation
                        if poison == (step, w):
                            loss = loss * float("inf")
                        loss.backward()
                sync.after_backward(stepper)
        stats = sync.synchronize()
        norms.append(sync.commit(stats.nonfinite, stepper))
    return norms


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["engine", "diloco"])
def test_both_modes_implement_the_protocol(mode):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode == "engine":
        sync = attach(model, "topk:ratio=0.5,ef=true", SimWorld(2), min_compress_numel=0)
    else:
        sync = DiLoCo(model, opt, torch.optim.SGD(model.parameters(), lr=1.0), SimWorld(2), 2, "none", hook=False)
    assert isinstance(sync, Synchronizer)
    assert sync.worker_ids == [0, 1] and sync.exchange in ("allgather", "allreduce") and sync.spec
    assert sync.last_schedule == []
    sync.detach()


def test_engine_through_the_protocol_equals_its_own_api():
    """Per-step mode: finalize + optimizer.step by hand, against the protocol's loop."""
    a, b = _model(), _model()
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    ea = attach(a, "topk:ratio=0.25,ef=true", SimWorld(3), min_compress_numel=0)
    eb = attach(b, "topk:ratio=0.25,ef=true", SimWorld(3), min_compress_numel=0)
    for step in range(4):
        for w in ea.worker_ids:
            with ea.worker(w):
                x, y = _batch(step, w)
                ((a(x) - y) ** 2).mean().backward()
        ea.finalize()
        opt_a.step()
    st = Stepper(opt_b, list(b.parameters()))
    norms = _protocol_loop(eb, b, st, 4)
    assert st.steps == 4 and st.skips == 0 and all(math.isfinite(n) for n in norms)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_diloco_through_the_protocol_equals_its_hooked_api():
    """DiLoCo: the optimizer's post-hook driving the syncs, against the protocol's loop."""
    a, b = _model(), _model()
    inner_a, inner_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    da = DiLoCo(a, inner_a, torch.optim.SGD(a.parameters(), lr=0.7, momentum=0.9, nesterov=True), SimWorld(2), 2,
                "intk:bits=4")
    db = DiLoCo(b, inner_b, torch.optim.SGD(b.parameters(), lr=0.7, momentum=0.9, nesterov=True), SimWorld(2), 2,
                "intk:bits=4", hook=False)
    for step in range(4):
        for w in da.worker_ids:
            with da.worker(w):
                inner_a.zero_grad(set_to_none=True)
                x, y = _batch(step, w)
                ((a(x) - y) ** 2).mean().backward()
                inner_a.step()
    st = Stepper(inner_b, list(b.parameters()))
    _protocol_loop(db, b, st, 4)
    assert st.steps == 8 and db.step == 4  # every worker stepped itself; two syncs happened
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def _same(x: object, y: object) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(_same(u, v) for u, v in zip(x, y))
    return x == y


def test_engine_skip_decision_leaves_no_trace():
    """A non-finite gradient on one worker: commit() skips on every worker; the model and the
    compressors' error memory are as if the step had never run."""
    runs = []
    for poison in (None, (1, 1)):
        model = _model()
        engine = attach(model, "topk:ratio=0.25,ef=true", SimWorld(2), min_compress_numel=0)
        st = Stepper(torch.optim.SGD(model.parameters(), lr=0.1), list(model.parameters()))
        norms = _protocol_loop(engine, model, st, 1 if poison is None else 2, poison=poison)
        runs.append((model, engine, st, norms))
    (m1, e1, s1, _), (m2, e2, s2, n2) = runs
    assert s2.skips == 1 and s2.steps == 1 and math.isnan(n2[1])
    assert all(p.grad is None for p in m2.parameters())  # a stray optimizer.step() would change nothing
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    assert _same(e1.state_dict(), e2.state_dict())


def test_diloco_skips_the_non_finite_worker_alone():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=1.0), SimWorld(2), 4, "none", hook=False)
    st = Stepper(inner, list(model.parameters()))
    norms = _protocol_loop(sync, model, st, 2, poison=(1, 0))
    assert st.skips == 1 and st.steps == 3  # worker 1 stepped at step 1; worker 0 skipped alone
    assert all(math.isfinite(n) for n in norms)  # the mean norm of those that stepped
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_accumulation_goes_through_no_sync_in_both_modes():
    for mode in ("engine", "diloco"):
        m1, m2 = _model(), _model()
        o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
        if mode == "engine":
            s1, s2 = attach(m1, "none", SimWorld(2)), attach(m2, "none", SimWorld(2))
        else:
            s1 = DiLoCo(m1, o1, torch.optim.SGD(m1.parameters(), lr=1.0), SimWorld(2), 1, "none", hook=False)
            s2 = DiLoCo(m2, o2, torch.optim.SGD(m2.parameters(), lr=1.0), SimWorld(2), 1, "none", hook=False)
        _protocol_loop(s1, m1, Stepper(o1, list(m1.parameters())), 2, accumulation=2)
        _protocol_loop(s2, m2, Stepper(o2, list(m2.parameters())), 2, accumulation=2)
        for p, q in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(p, q), mode


@pytest.mark.parametrize("opt_cls", ["onebit", "demo"])
def test_optimizers_shape_the_exchange_through_a_plan(opt_cls):
    """1-bit Adam and DeMo give an ExchangePlan; the bound engine asks at every step, and the
    protocol's commit does not clip what is then in p.grad."""
    model = _model()
    if opt_cls == "onebit":
        opt = OneBitAdam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, freeze_step=1)
        spec = "onebit"
    else:
        opt = DeMo(model.parameters(), lr=1e-3)
        spec = "demo"
    assert isinstance(opt, ShapesExchange) and isinstance(opt.exchange_plan(), ExchangePlan)
    engine = attach(model, spec, SimWorld(2), min_compress_numel=0)
    engine.bind_optimizer(opt)
    st = Stepper(opt, list(model.parameters()))
    _protocol_loop(engine, model, st, 3)
    assert engine.transform is not None and engine.compressing
    # onebit: step 1 is warm-up (clipped), then the momentum (unclipped); demo: never clipped
    assert st.unclipped == (2 if opt_cls == "onebit" else 3)
    engine.bind_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # a plain optimizer: no plan
    assert engine._shaper is None


def test_train_reads_top_to_bottom_with_one_path():
    """``gradzip train``'s loop: at most ~110 lines, no isinstance and no branch on the sync mode."""
    from gradzip.training import loop

    fn = next(n for n in ast.parse(inspect.getsource(loop)).body
              if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert fn.end_lineno - fn.lineno + 1 <= 110
    src = ast.unparse(fn)
    for word in ("isinstance", ".outer", "DiLoCo", "finalize", "after_inner_step", "sync_spec"):
        assert word not in src, word
