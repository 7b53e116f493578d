"""The optional paths of the compressor contract (gradzip/compress/fastpaths.py), parametrized over
the registry: every compressor that implements one gives the bits of its core path, and the core
contract alone is enough (a compressor seen without its optional paths still passes).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_compressors import DTYPES, EF_SPECS, SINGLE_ROUND, SPECS, rand, sim, solo

from gradzip.compress import create, fastpaths
from gradzip.compress.base import CAPABILITIES, Compressor
from gradzip.compress.ef import ErrorFeedback
from gradzip.compress.ef21 import EF21
from gradzip.compress.fastpaths import CompressSubtract, DecodeAggregate, ProvesFinite, SubtractSent


class CoreOnly(Compressor):
    """``inner`` seen through the core contract alone: none of the optional paths of
    gradzip.compress.fastpaths, so every caller takes the core path (the bucket methods are the
    inner's own: a BucketCompressor's unit is its tensors)."""

    def __init__(self, inner: Compressor) -> None:
        super().__init__(inner.config)
        self.inner = inner
        for attr in (*CAPABILITIES, "name", "exchange"):
            setattr(self, attr, getattr(inner, attr))

    def __getattribute__(self, attr):  # the core methods, delegated; an optional one is not here
        if attr in CORE_METHODS:
            return getattr(object.__getattribute__(self, "inner"), attr)
        return object.__getattribute__(self, attr)

    def compress(self, tensor, key=""):
        raise AssertionError("delegated")

    def decompress(self, payload, ctx):
        raise AssertionError("delegated")

    def payload_bytes(self, shape, dtype=torch.float32):
        raise AssertionError("delegated")


CORE_METHODS = {k for k, v in vars(Compressor).items() if callable(v) and not k.startswith("_")}
OPTIONAL = [c for c in vars(fastpaths).values() if isinstance(c, type) and c.__module__ == fastpaths.__name__]


def core_only(c: Compressor) -> Compressor:
    """The same compressor (error feedback and EF21 around the same inner) with no optional path."""
    if isinstance(c, (ErrorFeedback, EF21)):
        return type(c)(CoreOnly(c.inner))
    return CoreOnly(c)


def test_the_core_contract_is_small_and_the_optional_paths_are_not_in_it():
    optional = {k for cls in OPTIONAL if cls is not fastpaths.BucketCompressor for k in vars(cls)
                if not k.startswith("_")}
    assert optional and not optional & set(dir(Compressor)), optional & set(dir(Compressor))
    assert Compressor.__abstractmethods__ == {"compress", "decompress", "payload_bytes"}
    assert not isinstance(core_only(create("topk:ratio=0.1,ef=true")).inner, tuple(OPTIONAL))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_fast_paths_give_the_bits_of_the_core_path(spec, dtype):
    """Every registered compressor, with every optional path it implements (one-pass aggregation,
    fused error feedback, the finiteness proof), gives the same outputs and state, bit for bit, as
    the same compressor through the core contract alone: 3 steps of 4 workers through the Exchange."""
    if getattr(create(spec), "residual_from_output", False):
        pytest.skip("residual=reduced is another residual, not a faster path (tests/test_powersgd.py)")
    shapes = [(64, 33), (1000,), (7,)]
    fast, core = [create(spec) for _ in range(4)], [core_only(create(spec)) for _ in range(4)]
    for step in range(3):
        inputs = [[rand(s, dtype, seed=100 * step + 10 * w + i) for i, s in enumerate(shapes)] for w in range(4)]
        for a, b in zip(sim(fast, inputs), sim(core, inputs)):
            assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b)), spec
    for f, c in zip(fast, core):
        x, y = _state_tensors(f.state_dict()), _state_tensors(c.state_dict())
        assert len(x) == len(y) and all(torch.equal(s.view(torch.uint8), t.view(torch.uint8)) for s, t in zip(x, y))


def _state_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj.contiguous()]
    if isinstance(obj, dict):
        return [t for k in sorted(obj) for t in _state_tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _state_tensors(v)]
    return []


@pytest.mark.parametrize("spec", EF_SPECS)
def test_fused_error_feedback_equals_decode_and_subtract(spec, monkeypatch):
    """Compressors that update the residual in place (Compressor.subtract_sent, compress_subtract) give the same
    floats, bit for bit, as decoding into a new buffer and subtracting, on gradients with zeros of
    both signs, infs and NaNs; and a non-finite entry never reaches the memory."""
    shapes = [(64, 33), (1000,), (7,)]

    def grads(step):
        gs = [rand(s, seed=100 * step + i) for i, s in enumerate(shapes)]
        gs[1][:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")]) if step == 1 else gs[1][:4]
        gs[2][0] = -0.0
        return gs

    fused = create(spec)
    plain = ErrorFeedback(CoreOnly(create(spec).inner))  # the same inner through the core contract
    inner, used, proofs = fused.inner, [], []
    if isinstance(inner, SubtractSent):
        orig = type(inner).subtract_sent_batch
        monkeypatch.setattr(inner, "subtract_sent_batch", lambda *a: used.append(orig(inner, *a)) or used[-1])
    if isinstance(inner, CompressSubtract):  # the encode and the residual in one pass (1-bit codes, C kernels)
        orig_cs = type(inner).compress_subtract_batch
        monkeypatch.setattr(inner, "compress_subtract_batch",
                            lambda *a: (r := orig_cs(inner, *a)) is not None and used.append(True) or r)
    if isinstance(inner, ProvesFinite):
        proof = type(inner).sent_proves_finite_batch
        monkeypatch.setattr(inner, "sent_proves_finite_batch", lambda *a: proofs.append(proof(inner, *a)) or proofs[-1])
    for step in range(3):
        solo(fused, grads(step))
        solo(plain, grads(step))
        for a, b in zip(fused.state_dict()["memory"]["b"], plain.state_dict()["memory"]["b"]):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), spec  # bits, -0.0 included
            assert torch.isfinite(a).all()
    if create(spec).inner.name in ("topk", "onebit", "signsgd"):
        assert used and all(used), f"{spec}: the fused path was not taken"
        # finite steps skip the sanitising pass; the step with inf and NaN (step 1) does not
        assert proofs == [True, False, True], f"{spec}: {proofs}"


ALLGATHER = [s for s in SINGLE_ROUND if create(s).collective == "allgather"]


@pytest.mark.parametrize("spec", ALLGATHER)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ranks", [7, 8])
def test_one_pass_aggregation_equals_decode_each_and_aggregate(spec, dtype, ranks):
    """Compressors that aggregate the ranks' payloads in one pass (Compressor.decode_aggregate) give
    the same floats as decoding every payload and aggregating, at 8 ranks whose top-k indices
    overlap; and the exchange takes that path."""
    shapes = [(64, 33), (1000,), (7,)]
    comps = [create(spec) for _ in range(ranks)]
    common = rand((sum(math.prod(s) for s in shapes),), seed=99)  # shared large entries: overlapping indices
    per_rank, ctx = [], None
    for w, c in enumerate(comps):
        noise = rand(common.shape, seed=w)
        flat = (common * 0.3 + noise).to(dtype)  # votes both ways, and ties at an even rank count
        tensors = list(torch.split(flat, [math.prod(s) for s in shapes]))
        payload, ctx = c.compress_batch([t.view(s) for t, s in zip(tensors, shapes)], "b")
        per_rank.append(tuple(p.clone() for p in payload))
    c = comps[0]
    fused = c.decode_aggregate_batch(per_rank, ctx) if isinstance(c, DecodeAggregate) else None
    parts = [c.decompress_batch(p, ctx) for p in per_rank]
    plain = [c.aggregate([part[i] for part in parts]) for i in range(len(shapes))]
    if fused is None:
        taken = create(spec).name in ("topk", "onebit", "threshold", "signsgd") and "ef=ef21" not in spec
        assert not taken or dtype != torch.float32, f"{spec}: the one-pass path was not taken"
        return
    for a, b in zip(fused, plain):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), spec


def test_the_exchange_aggregates_in_one_pass(monkeypatch):
    from gradzip.compress.topk import TopK
    calls = []
    monkeypatch.setattr(TopK, "decompress", lambda *a: calls.append(1) or pytest.fail("decoded per rank"))
    comps = [create("topk:ratio=0.1,ef=true") for _ in range(4)]
    out = sim(comps, [[rand((50,), seed=w)] for w in range(4)])
    assert calls == [] and all(torch.equal(o[0], out[0][0]) for o in out)
