"""Steps with a non-finite gradient are skipped on every worker, and leave no trace: the engine's
undoable steps (error memory, PowerSGD's Q, counters, the server memory of twophase) over every
registered compressor and exchange scheme, flat and hierarchical, on the sim backend. The
multi-process side (gloo, mpi, fault injection) is in tests/test_faults.py."""

from __future__ import annotations

import copy

import pytest
import torch
from test_engine import Net, data, grads, loss_of, run_ranks, sgd_step

from gradzip.comm.sim import SimWorld
from gradzip.compress import create, registry
from gradzip.engine import attach

KW = dict(bucket_cap_mb=0.002, min_compress_numel=32)
# Every spec with error feedback runs here, including those where it cannot help: their one-time
# caveat (tested in test_core.py) is expected, not news.
pytestmark = pytest.mark.filterwarnings("ignore:.*(contraction|error feedback).*:UserWarning")


def _specs() -> list[str]:
    """Every compressor as registered, with error feedback, and under every scheme it declares."""
    out = []
    for name, cls in sorted(registry().items()):
        out.append(name)
        if not create(name).identity and not cls.default_ef:
            out.append(f"{name}:ef=true")
        out += [f"{name}:ef=true,exchange={s}" for s in cls.schemes if s != cls.collective]
        if cls.biased:
            out.append(f"{name}:ef=ef21")
    return out + ["powersgd:residual=reduced"]  # error feedback against the reduced result


def _step(engine, model, batches, poison: dict[int, float] | None = None):
    """One step; ``poison`` maps a worker to the value written into one of its gradients."""
    for w in engine.worker_ids:
        with engine.worker(w):
            hook = None
            if poison and w in poison:
                value = poison[w]
                hook = model.fc2.weight.register_hook(lambda g, v=value: g.clone().index_fill_(0, torch.tensor([3]), v))
            loss_of(model, batches[w]).backward()
            if hook is not None:
                hook.remove()
    return engine.finalize()


def _equal_states(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _equal_states(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _equal_states(x, y)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=False)
    else:
        assert a == b


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hierarchical"])
@pytest.mark.parametrize("spec", _specs())
def test_a_skipped_step_leaves_no_trace(spec, hierarchical):
    """Two good steps, a step with NaN on worker 1 (skipped), a good step: bit for bit the same
    state, gradients and model as two good steps and then that good step."""
    torch.manual_seed(11)
    model = Net()
    twin = copy.deepcopy(model)
    world = dict(ranks_per_node=2) if hierarchical else {}
    engine = attach(model, spec, SimWorld(4, **world), hierarchical=hierarchical, **KW)
    ref = attach(twin, spec, SimWorld(4, **world), hierarchical=hierarchical, **KW)
    for step in range(2):
        for e, m in ((engine, model), (ref, twin)):
            st = _step(e, m, data(4, step))
            assert st.nonfinite == 0 and e.agree_finite(st)
            sgd_step(m)
    before = engine.state_dict()
    st = _step(engine, model, data(4, 9), poison={1: float("nan")})
    assert st.nonfinite == 1 and not engine.agree_finite(st)
    engine.skip_step()
    assert all(p.grad is None for p in model.parameters())
    _equal_states(engine.state_dict(), before)
    for e, m in ((engine, model), (ref, twin)):
        assert e.agree_finite(_step(e, m, data(4, 2)))
    for a, b in zip(grads(model), grads(twin)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _equal_states(engine.state_dict(), ref.state_dict())


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_every_kind_of_non_finite_value_is_seen_on_any_worker(value):
    torch.manual_seed(12)
    model = Net()
    engine = attach(model, "onebit", SimWorld(3), **KW)
    st = _step(engine, model, data(3), poison={0: value, 2: value})
    assert st.nonfinite == 2
    engine.skip_step()
    st = _step(engine, model, data(3, 1))
    assert st.nonfinite == 0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_are_checked_in_fp32(dtype):
    """Large finite low-precision gradients do not overflow the check (it sums in fp32; the
    gradient's own dtype would overflow at fp16's 65504); inf in them is seen."""
    torch.manual_seed(13)
    model = Net().to(dtype)
    engine = attach(model, "topk:ratio=0.2,ef=true", SimWorld(2), **KW)
    batches = [(x.to(dtype), y.to(dtype)) for x, y in data(2)]
    big = 6e4 if dtype == torch.float16 else 1e30
    assert _step(engine, model, batches, poison={0: big, 1: big}).nonfinite == 0
    assert _step(engine, model, batches, poison={1: float("inf")}).nonfinite == 1
    engine.skip_step()


def test_a_kept_step_is_kept_and_state_dict_sees_it():
    """Without skip_step the step's updates stand, whatever is called next."""
    torch.manual_seed(14)
    model = Net()
    engine = attach(model, "topk:ratio=0.1,ef=true", SimWorld(2), **KW)
    _step(engine, model, data(2))
    mem = engine.state_dict()["compressors"][0]["memory"]
    assert any(float(t.abs().sum()) > 0 for ts in mem.values() for t in ts), "the first step left a residual"


@pytest.mark.timeout(60)
def test_real_mode_ranks_agree_and_skip_together():
    """Real-backend code path (a threaded SimWorld, one engine per thread): rank 1's NaN makes
    agree_finite False on both ranks; both skip and the next step is finite and equal."""
    torch.manual_seed(15)
    base = Net()
    world = SimWorld(2, threaded=True, timeout=30)
    out: dict[int, list] = {}

    def rank_main(r: int) -> None:
        model = copy.deepcopy(base)
        engine = attach(model, "onebit", world[r], **KW)
        verdicts = []
        for step in range(3):
            model.zero_grad(set_to_none=True)
            hook = None
            if step == 1 and r == 1:
                hook = model.fc2.weight.register_hook(lambda g: g.clone().fill_(float("nan")))
            loss_of(model, data(2, step)[r]).backward()
            if hook is not None:
                hook.remove()
            st = engine.finalize()
            ok = engine.agree_finite(st)
            verdicts.append((st.nonfinite, ok))
            if ok:
                sgd_step(model)
            else:
                engine.skip_step()
        out[r] = [verdicts, grads(model)]

    run_ranks(rank_main, 2)
    assert out[0][0] == [(0, True), (0, False), (0, True)]
    assert out[1][0] == [(0, True), (1, False), (0, True)]
    for a, b in zip(out[0][1], out[1][1]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("spec", [s for s in _specs() if "exchange=sparse" not in s])
def test_a_buckets_error_memory_moves_between_keys(spec):
    """What the DDP hook relies on at DDP's bucket rebuild: a scheme's worker memory of a key can be
    read out flat, written under another key, and freed (twophase keeps it per chunk)."""
    from gradzip.engine.schemes import SchemeState

    comp = create(spec)
    scheme = SchemeState(comp, SimWorld(3)[0])
    flat = torch.randn(10)
    scheme.set_residual("bucket0~x", flat, [torch.Size([2, 3]), torch.Size([4])])
    got = scheme.residual("bucket0~x", 10)
    if comp.residuals("bucket0~x") is None and got is None:  # no memory to move (ef=false), none kept
        assert comp.state_dict().get("memory") in (None, {})
        return
    torch.testing.assert_close(got, flat, rtol=0, atol=0)
    scheme.forget("bucket0~x")
    assert scheme.residual("bucket0~x", 10) is None and not comp.state_dict().get("memory")
