"""Generic compressor tests, parametrized over the registry at collection time: a compressor
registered later (one new file in gradzip/compress/) is covered with no edit here. Multi-round
compressors are driven through the real Exchange over a SimWorld, so only the contract is assumed.

Then specific tests: top-k exactness, random-k unbiasedness, sign codes, bit packing, `gradzip ls`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import typing
import warnings

import numpy as np
import pytest
import torch

from gradzip.comm.sim import SimWorld
from gradzip.compress import bitpack, create, registry
from gradzip.compress.select import _topk_torch, topk_indices
from gradzip.engine.exchange import Exchange
from gradzip.errors import SpecError

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(), (1,), (0,), (7,), (13, 5), (3, 4, 5), (1000,), (64, 33)]


def _specs() -> list[str]:
    """Canonical specs: each registered compressor as default, with EF and without EF, and with
    EF21 where it is biased."""
    out: list[str] = []
    for name, cls in registry().items():
        for s in (name, f"{name}:ef=true", f"{name}:ef=false") + ((f"{name}:ef=ef21",) if cls.biased else ()):
            with warnings.catch_warnings():  # EF caveats: tested in test_core.py, not this list's business
                warnings.simplefilter("ignore")
                spec = create(s).spec
            if spec not in out:
                out.append(spec)
    return out + [create(s).spec for s in VARIANTS]


VARIANTS = ["powersgd:residual=reduced"]  # options that change what error feedback does


SPECS = _specs()
SINGLE_ROUND = [s for s in SPECS if create(s).rounds == 1]
LOSSLESS = [s for s in SPECS if create(s).lossless]
EF_SPECS = [s for s in SPECS if s.endswith("ef=true")]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=gen(seed)).to(dtype)


def nbytes(payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


def solo(c, tensors, key="b"):
    """One step for a world of one rank through the bucket API, as the Exchange runs it (the mean
    over one rank is the rank's own payload). Returns (outputs, payload bytes over all rounds)."""
    payload, ctx = c.compress_batch(tensors, key)
    sent = nbytes(payload)
    for _ in range(1, c.rounds):
        payload, ctx = c.next_round_batch(tuple(p.clone() for p in payload), ctx)
        sent += nbytes(payload)
    parts = c.decompress_batch(tuple(p.clone() for p in payload), ctx)
    if c.collective == "allgather":
        parts = [c.aggregate([p]) for p in parts]
    return parts, sent


def solo_single(c, x, key="s"):
    """The single-tensor API (compress / next_round / decompress) for a world of one rank."""
    payload, ctx = c.compress(x, key)
    sent = nbytes(payload)
    for _ in range(1, c.rounds):
        payload, ctx = c.next_round(tuple(p.clone() for p in payload), ctx)
        sent += nbytes(payload)
    out = c.decompress(tuple(p.clone() for p in payload), ctx)
    return (c.aggregate([out]) if c.collective == "allgather" else out), sent


def sim(comps, inputs, key="b"):
    """One bucket exchange on every worker of a SimWorld; inputs[w] is worker w's tensor list."""
    world = SimWorld(len(comps))
    exs = [Exchange(c, world[w], [t.clone() for t in inputs[w]], key) for w, c in enumerate(comps)]
    for e in exs:
        e.start()
    while not all([e.advance() for e in exs]):  # a list: every worker advances each round
        pass
    return [e.result() for e in exs]


# ----------------------------------------------------------------------------- generic
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_shape_dtype_and_no_input_change(spec, dtype):
    c = create(spec)
    for i, shape in enumerate(SHAPES):
        x = rand(shape, dtype, seed=i)
        keep = x.clone()
        out, _ = solo_single(c, x, key=f"s{i}")
        assert (out.shape, out.dtype) == (x.shape, dtype), (spec, shape)
        assert torch.equal(x, keep), f"{spec} modified its input of shape {shape}"
        assert torch.isfinite(out.float()).all(), (spec, shape)
    # The bucket path, through the Exchange, with two workers holding different data.
    comps = [create(spec) for _ in range(2)]
    inputs = [[rand(s, dtype, seed=10 * w + i) for i, s in enumerate(SHAPES)] for w in range(2)]
    for res in sim(comps, inputs):
        assert [(t.shape, t.dtype) for t in res] == [(torch.Size(s), dtype) for s in SHAPES], spec


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_declared_payload_bytes_are_exact(spec, dtype):
    """Exact for fixed-size payloads; for data-dependent ones (threshold) an upper bound."""
    c = create(spec)
    same = (lambda a, b: a == b) if c.fixed_size else (lambda a, b: a <= b)
    for i, shape in enumerate(SHAPES):
        _, sent = solo_single(c, rand(shape, dtype, seed=i), key=f"s{i}")
        assert same(sent, c.payload_bytes(shape, dtype)), (spec, shape, sent)
    bucket = [(13, 5), (7,), (64, 33), (3, 4, 5), (64, 33), (1,), (0,)]
    _, sent = solo(c, [rand(s, dtype, seed=i) for i, s in enumerate(bucket)])
    assert same(sent, c.batch_payload_bytes(bucket, dtype)), (spec, sent)


@pytest.mark.parametrize("spec", EF_SPECS)
def test_ef_invariant_compensated_is_transmitted_plus_residual(spec):
    c = create(spec)
    shapes = [(64, 33), (1000,), (7,)]
    memory = [torch.zeros(s) for s in shapes]
    for step in range(3):
        grads = [rand(s, seed=100 * step + i) for i, s in enumerate(shapes)]
        # One rank: what the exchange returns is exactly what this rank transmitted.
        transmitted, _ = solo(c, grads)
        new = c.state_dict()["memory"]["b"]
        for g, m, t, r in zip(grads, memory, transmitted, new):
            # fp32 rounding of t + r, relative to the largest term (random-k scales t by n/k)
            atol = 1e-6 * (1.0 + float(t.abs().max()) + float(r.abs().max()))
            torch.testing.assert_close(g + m, t + r, rtol=0, atol=atol)
        memory = [r.clone() for r in new]
    if not c.lossless:
        assert memory[0].abs().sum() > 0, f"{spec}: a lossy compressor left no residual on a 64x33 matrix"


@pytest.mark.parametrize("spec", [s for s in EF_SPECS if s in SINGLE_ROUND])
def test_ef_invariant_per_worker_in_a_world_of_4(spec):
    comps = [create(spec) for _ in range(4)]
    for step in range(2):
        for w, c in enumerate(comps):
            g = rand((300,), seed=10 * step + w)
            before = c.state_dict()["memory"].get("b", [torch.zeros(300)])[0].clone()
            payload, ctx = c.compress_batch([g], "b")
            transmitted = c.decompress_batch(tuple(p.clone() for p in payload), ctx)[0]
            after = c.state_dict()["memory"]["b"][0]
            atol = 1e-6 * (1.0 + float(transmitted.abs().max()) + float(after.abs().max()))
            torch.testing.assert_close(g + before, transmitted + after, rtol=0, atol=atol)


@pytest.mark.parametrize("spec", LOSSLESS)
def test_lossless_averages_exactly_like_none(spec):
    inputs = [[rand((13, 5), seed=w), rand((1000,), seed=9 + w)] for w in range(4)]
    ref = sim([create("none") for _ in range(4)], inputs)[0]
    exact = [sum(inputs[w][i] for w in range(4)) / 4 for i in range(2)]  # fp32 sum, as the ring does
    for res in sim([create(spec) for _ in range(4)], inputs):
        for r, e, x in zip(res, ref, exact):
            assert torch.equal(r, e) and torch.equal(r, x), spec


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SINGLE_ROUND)
def test_sim_result_is_mean_of_workers_decompressed_payloads(spec, dtype):
    shapes = [(64, 33), (7,), (1,)]
    inputs = [[rand(s, dtype, seed=10 * w + i) for i, s in enumerate(shapes)] for w in range(4)]
    result = sim([create(spec) for _ in range(4)], inputs)
    local = []  # each worker decompresses its own payload (fresh instances: same seeds, same state)
    for w in range(4):
        c = create(spec)
        payload, ctx = c.compress_batch(inputs[w], "b")
        local.append(c.decompress_batch(tuple(p.clone() for p in payload), ctx))
    # Rounding allowed: a few units of the coarsest float type on the way (payload or output).
    eps = max(torch.finfo(t.dtype).eps for t in [*payload, inputs[0][0]] if t.is_floating_point())
    for i in range(len(shapes)):
        parts = [loc[i] for loc in local]
        if c.collective == "allreduce":
            want = torch.stack([p.float() for p in parts]).mean(0)
        else:
            want = c.aggregate(parts).float()
        atol = 4 * eps * max(1.0, max(float(p.float().abs().max()) for p in parts))
        for res in result:  # every worker got the same answer
            torch.testing.assert_close(res[i].float(), want, rtol=0, atol=atol)


@pytest.mark.parametrize("spec", SPECS)
def test_state_dict_round_trip_through_torch_save(spec):
    bucket = [(64, 33), (1000,)]
    c = create(spec)
    for step in range(2):
        solo(c, [rand(s, seed=10 * step + i) for i, s in enumerate(bucket)])
    buf = io.BytesIO()
    torch.save(c.state_dict(), buf)
    buf.seek(0)
    restored = create(spec)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    fresh = create(spec)
    x = [rand(s, seed=99 + i) for i, s in enumerate(bucket)]
    want, _ = solo(c, x)
    got, _ = solo(restored, x)
    assert all(torch.equal(a, b) for a, b in zip(want, got)), spec
    if spec.endswith("ef=true") and not c.lossless:  # the error memory matters: starting fresh differs
        other, _ = solo(fresh, x)
        assert not all(torch.equal(a, b) for a, b in zip(want, other)), spec


@pytest.mark.parametrize("spec", SPECS)
def test_spec_round_trip(spec):
    c = create(spec)
    assert create(c.spec).spec == c.spec == spec
    assert type(create(c.spec)) is type(c)


def test_the_core_contract_has_at_most_16_public_methods():
    """``Compressor``'s own body stays small: at most 16 public methods (the step undo and residual
    family lives in the ``ResidualState`` mixin, which every compressor still inherits)."""
    from gradzip.compress.base import Compressor, ResidualState

    own = [k for k, v in vars(Compressor).items()
           if not k.startswith("_") and callable(v) and not isinstance(v, (type, property))]
    assert len(own) <= 16, sorted(own)
    family = ("begin_step", "end_step", "residuals", "set_residuals", "forget")
    assert not set(family) & set(own) and all(k in vars(ResidualState) for k in family)
    assert issubclass(Compressor, ResidualState)
    for name, cls in registry().items():  # every registered compressor keeps the whole contract
        assert all(callable(getattr(cls, k, None)) for k in (*own, *family)), name
    assert isinstance(vars(Compressor)["spec"], property)


def _field_cases():
    for name, cls in registry().items():
        hints = typing.get_type_hints(cls.Config)
        for f in dataclasses.fields(cls.Config):
            yield name, f.name, hints[f.name]


@pytest.mark.parametrize("name,field,typ", list(_field_cases()))
def test_bad_parameter_values_raise_spec_error(name, field, typ):
    bad = ["maybe"] if typ is bool else ["abc"] if typ in (int, float) else ["no-such-value"]
    if field == "ratio":
        bad += ["0", "-0.5", "1.5", "nan"]
    if field == "rank":
        bad += ["0"]
    for value in bad:
        with pytest.raises(SpecError) as e:
            create(f"{name}:{field}={value}")
        msg = str(e.value)
        assert field in msg and name in msg and "\n" not in msg, msg
        if field == "ratio" and value != "abc":  # numbers out of range: the message gives the range
            assert "0 < ratio <= 1" in msg, msg
    # a good value (the default) round-trips through the spec, strings (fp8.format) included
    default = getattr(registry()[name].Config(), field)
    good = create(f"{name}:{field}={'true' if default is True else 'false' if default is False else default}")
    assert getattr(good.config, field) == default and create(good.spec).spec == good.spec
    assert f"{field}={getattr(good.config, field)}".lower() in good.spec


@pytest.mark.parametrize("name", list(registry()))
def test_unknown_name_and_parameter_list_the_choices(name):
    with pytest.raises(SpecError) as e:
        create(f"{name}x9")
    assert all(n in str(e.value) for n in registry())
    with pytest.raises(SpecError) as e:
        create(f"{name}:no_such_param=1")
    valid = [f.name for f in dataclasses.fields(registry()[name].Config)] + ["ef"]
    assert "no_such_param" in str(e.value) and all(v in str(e.value) for v in valid)


# ----------------------------------------------------------------------------- specific
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_casts(dtype):
    x = rand((1001,), dtype)
    for name, wire in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        out, sent = solo_single(create(name), x)
        assert torch.equal(out, x.to(wire).to(dtype)) and sent == 2002


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_keeps_exactly_the_largest(dtype):
    x = rand((50, 20), dtype)
    out, sent = solo_single(create("topk:ratio=0.05"), x)
    kept = out.view(-1).nonzero().view(-1)  # randn has no exact zeros
    assert kept.numel() == 50 and torch.equal(out.view(-1)[kept], x.view(-1)[kept])
    want = x.view(-1).abs().float().topk(50).values  # bf16 has ties: compare magnitudes, not indices
    assert torch.equal(x.view(-1)[kept].abs().float().sort(descending=True).values, want)
    assert sent == 50 * (x.element_size() + 4)
    assert create("topk:ratio=0.01").payload_bytes(300) == 3 * 8  # 0.01 * 300 is 3, not 4
    assert create("topk:ratio=0.07").payload_bytes(100) == 7 * 8  # 0.07 * 100 = 7.000000000000001
    assert create("topk:ratio=0.01").payload_bytes(1 << 24) == 167773 * 8  # ceil(167772.16)
    assert create("topk:ratio=1e-9").payload_bytes(5) == 8 and create("topk").payload_bytes(0) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("data", ["normal", "ties", "constant", "adversarial"])
def test_topk_selection_is_exact(data, dtype):
    n, sample, seed = 300_000, 1 << 14, 5  # n > 4 * sample: the sampled-threshold path
    g = gen(1)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4)
    if data == "ties":
        x = torch.randint(-4, 5, (n,), generator=g).float()
    elif data == "constant":
        x = torch.full((n,), -0.5)
    elif data == "adversarial":  # the big values sit exactly where the sample looks: retries, fallback
        x[np.random.default_rng(seed).integers(0, n, sample)] = 1e3
    x = x.to(dtype)
    for k in (1, 17, n // 1000, n // 100, n // 8, n // 3):
        idx = topk_indices(x, k, sample=sample, seed=seed)
        assert idx.dtype == torch.int32 and idx.numel() == k
        assert torch.equal(idx, idx.unique()), "indices must be distinct and ascending"
        got = x[idx].abs().float().sort().values
        want = x.abs().float().topk(k).values.sort().values
        assert torch.equal(got, want), (data, k)
        # The off-CPU path (torch.topk on the keys) selects the same magnitudes.
        alt = _topk_torch(x.view(bitpack.INT_VIEW[dtype]), k)
        assert torch.equal(x[alt].abs().float().sort().values, want)


def test_topk_selection_edge_sizes():
    for n in (0, 1, 2, 9, 1000):
        x = rand((n,))
        for k in {0, 1, n // 2, n - 1, n}:
            if 0 <= k <= n:
                idx = topk_indices(x, k)
                assert idx.numel() == k and torch.equal(x[idx].abs().sort().values,
                                                        x.abs().topk(k).values.sort().values)


def test_randomk_is_unbiased_and_scaled_variance_matches():
    n, steps = 64, 3000
    x = rand((n,), seed=3)
    c = create("randomk:ratio=0.25,seed=7")
    k = 16
    mean = torch.zeros(n)
    for _ in range(steps):
        out, sent = solo_single(c, x, key="k")
        mean += out / steps
    assert sent == k * 4 and not c.biased
    z = (mean - x) / (x.abs() * math.sqrt((n / k - 1) / steps))  # per-coordinate z-scores
    assert z.abs().max() < 4.5, z.abs().max()
    assert 0.6 < z.pow(2).mean() < 1.5  # indices uniform: the variance is the predicted one
    biased = create("randomk:ratio=0.25,seed=7,unbiased=false")
    assert biased.biased and type(biased).biased is False
    mean_b = sum(solo_single(biased, x, key="k")[0] for _ in range(steps)) / steps
    assert ((mean_b - x) / (x.abs() * math.sqrt((n / k - 1) / steps))).abs().max() > 20


def test_randomk_indices_shared_distinct_and_fresh_each_step():
    a, b = create("randomk:ratio=0.1,seed=1"), create("randomk:ratio=0.1,seed=1")
    x = rand((997,))
    first = a.compress(x, "k")[1].indices
    assert torch.equal(first, b.compress(x * 2, "k")[1].indices)  # same draw on every rank
    assert first.numel() == 100 and first.unique().numel() == 100
    assert not torch.equal(first, a.compress(x, "k")[1].indices)  # next step: new draw
    assert not torch.equal(first, create("randomk:ratio=0.1,seed=1").compress(x, "other")[1].indices)
    big = create("randomk:ratio=0.001").indices(1 << 22, "k")  # the sampling path, k << n
    assert big.numel() == 4195 and big.unique().numel() == 4195


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_onebit_is_scaled_sign(dtype):
    x = rand((1001,), dtype)
    x[3] = 0.0
    out, sent = solo_single(create("onebit:ef=false"), x)
    scale = x.float().abs().mean()
    want = torch.where(x < 0, -scale, scale).to(dtype)
    assert torch.equal(out, want) and sent == 126 + 4


def test_signsgd_majority_vote():
    signs = torch.tensor([[1, 1, -1, -1, 1], [1, -1, -1, 1, -1], [1, 1, 1, -1, -1], [-1, 1, -1, -1, 1]])
    scales = [1.0, 2.0, 3.0, 6.0]
    inputs = [[signs[w].float() * scales[w]] for w in range(4)]
    votes = signs.sum(0)  # [2, 2, -2, -2, 0]
    res = sim([create("signsgd") for _ in range(4)], inputs)
    assert torch.equal(res[0][0], torch.sign(votes).float() * 3.0)  # tie -> 0; mean scale 3


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 1000, 1001])
def test_bitpack_round_trip_and_bit_order(n):
    bits = torch.rand(n, generator=gen(n)) < 0.5
    packed = bitpack.pack(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == bitpack.packed_numel(n) == math.ceil(n / 8)
    assert np.array_equal(packed.numpy(), np.packbits(bits.numpy(), bitorder="little"))
    assert torch.equal(bitpack.unpack(packed, n), bits)
    assert torch.equal(bitpack._pack_torch(bits), packed)  # the off-CPU implementation agrees
    assert torch.equal(bitpack._unpack_torch(packed, n), bits)
    for dtype in DTYPES:
        x = torch.where(bits, -1.5, 2.0).to(dtype)
        assert torch.equal(bitpack.unpack_signs(bitpack.pack_signs(x), n, 0.25, dtype),
                           torch.where(bits, -0.25, 0.25).to(dtype))


@pytest.mark.parametrize("n", [bitpack._PACK_CHUNK, bitpack._PACK_CHUNK + 3, 3 * bitpack._PACK_CHUNK + 13])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pack_signs_in_chunks_gives_the_bytes_of_one_packbits(n, dtype):
    x = torch.randn(n, generator=gen(n)).to(dtype)
    x[::7] = -0.0
    x[1::11] = 0.0
    ref = np.packbits(x.view(bitpack.INT_VIEW[dtype]).numpy() < 0, bitorder="little")
    assert np.array_equal(bitpack.pack_signs(x).numpy(), ref)
    assert np.array_equal(bitpack._pack_torch(x.view(bitpack.INT_VIEW[dtype]) < 0).numpy(), ref)


def test_bitpack_explicit_bits_and_errors():
    assert bitpack.pack(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)).tolist() == [129, 1]
    assert bitpack.pack_signs(torch.tensor([-0.0, 0.0, -1.0])).tolist() == [0b101]
    with pytest.raises(ValueError, match="expected 2 packed"):
        bitpack.unpack(torch.zeros(3, dtype=torch.uint8), 9)


def test_gradzip_ls_lists_every_compressor(capsys):
    from gradzip.cli import main

    assert main(["ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, cls in registry().items():
        row = next(line for line in lines if line.split()[0] == name)
        assert cls.collective in row and cls.description in row
        assert ("yes" if cls.biased else "no") in row.split()[2:4]
        for f in dataclasses.fields(cls.Config):
            assert f"{f.name}=" in row
        assert "|".join(s + ("*" if s == cls.collective else "") for s in cls.schemes) in row.split()
    assert main(["ls", "--json"]) == 0
    items = {it["name"]: it for it in json.loads(capsys.readouterr().out)}
    assert set(items) == set(registry())
    assert {p["name"]: p["default"] for p in items["topk"]["parameters"]} == {
        "ratio": 0.01, "ef": False, "exchange": "allgather"}
    assert items["onebit"]["schemes"] == ["allgather", "twophase"]
    assert items["onebit"]["default_exchange"] == "allgather"


def test_majority_vote_on_packed_bits_counts_ties_and_abstentions():
    from gradzip.compress import bitpack
    gen = torch.Generator().manual_seed(3)
    for ranks in (1, 2, 3, 4, 8, 9, 16):
        signs = torch.randint(0, 2, (ranks, 1001), generator=gen).bool()  # True = negative vote
        neg, tie = bitpack.majority_signs([bitpack.pack(s) for s in signs])
        count = signs.sum(0)
        assert torch.equal(bitpack.unpack(neg, 1001), count * 2 > ranks)
        if ranks % 2:
            assert tie is None
        else:
            assert torch.equal(bitpack.unpack(tie, 1001), count * 2 == ranks) and bool((count * 2 == ranks).any())
    # a rank whose gradient is all zeros abstains (scale 0): the general path handles it
    c = create("signsgd")
    payloads = [c.compress_batch([t], "b") for t in (rand((50,), seed=1), torch.zeros(50), rand((50,), seed=2))]
    assert c.decode_aggregate_batch([p for p, _ in payloads], payloads[0][1]) is None
