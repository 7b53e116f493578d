"""``int8bins``: exact payload bytes, decoded values that are the bin means, the round-trip error
bound, zero, constant, empty and non-finite tensors, parameter checks, and error feedback. The
generic contract (shapes, dtypes, EF invariant, one-pass aggregation, schemes, state) is covered by
the registry-wide tests."""

from __future__ import annotations

import math

import pytest
import torch

from gradzip.compress import create
from gradzip.errors import SpecError

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def encode(c, x, key="k"):
    payload, ctx = c.compress(x, key)
    return payload, c.decompress(tuple(p.clone() for p in payload), ctx)


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 4097])
def test_payload_bytes_are_n_plus_256_fp32_means(n):
    c = create("int8bins")
    assert c.fixed_size and c.payload_bytes(n) == n + 4 * 256 == c.payload_bytes((n,), torch.bfloat16)
    (codes, means), out = encode(c, randn(n, seed=n).to(torch.bfloat16))
    assert (codes.dtype, codes.shape, means.dtype, means.shape) == (torch.uint8, (n,), torch.float32, (256,))
    assert codes.numel() + 4 * means.numel() == c.payload_bytes(n)
    assert out.dtype == torch.bfloat16 and out.shape == (n,)


@pytest.mark.parametrize("sigmas", [6.0, 2.0])
def test_decoded_values_are_the_means_of_the_bins(sigmas):
    x = randn(20_000, seed=1) * 3 + 0.5
    (codes, means), out = encode(create(f"int8bins:sigmas={sigmas}"), x)
    xd = x.double()
    for b in range(256):
        members = xd[codes == b]
        want = members.mean().float() if members.numel() else torch.tensor(0.0)
        assert torch.equal(means[b], want), b
    assert torch.equal(out, means[codes.long()])
    # The bins: uniform over mean ± sigmas·std, clamped at the ends (the direct formula, in fp64,
    # agrees but within 1e-3 of a bin's width from a boundary, where fp32 rounding may decide).
    mu, sd = xd.mean(), xd.std(correction=0)
    pos = (xd - mu) / (2 * sigmas * sd / 256) + 128
    ref = pos.floor().clamp(0, 255)
    near = (pos - pos.round()).abs() < 1e-3
    assert torch.equal(codes.double()[~near], ref[~near]) and near.float().mean() < 0.01
    assert (codes[x.argsort()].diff() >= 0).all(), "codes grow with the values: each bin is an interval"
    if sigmas == 2.0:  # clipped: the end bins hold everything beyond ±2σ (~4.6 % of a Gaussian)
        assert 0.03 < float(((codes == 0) | (codes == 255)).float().mean()) < 0.06


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_error_is_below_the_bin_width(dtype):
    """Gaussian data has nothing beyond ±6σ here, so every value decodes to a point of its own bin:
    |error| < w = 12σ/256 (plus the output dtype's rounding)."""
    x = randn(100_000, seed=2).mul(0.01).add(0.002).to(dtype)
    _, out = encode(create("int8bins"), x)
    xf = x.float()
    w = 12 * float(xf.std(correction=0)) / 256
    err = (out.float() - xf).abs()
    assert (err <= w * (1 + 1e-4) + torch.finfo(dtype).eps * xf.abs()).all(), float(err.max() / w)
    assert float(err.max()) > w / 4  # the bound is not vacuous
    # The errors of a bin sum to zero: the tensor's sum survives (up to fp32 rounding).
    if dtype == torch.float32:
        assert abs(float(out.double().sum() - xf.double().sum())) < 1e-5 * float(xf.double().abs().sum())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_constant_and_empty_tensors_are_exact(dtype):
    c = create("int8bins")
    (_, means), out = encode(c, torch.zeros(12, dtype=dtype))
    assert torch.equal(out, torch.zeros(12, dtype=dtype)) and torch.equal(means, torch.zeros(256))
    big = {torch.float16: 65504.0}.get(dtype, 3e38)
    for v in (-3.25, 0.1, 1e-30, 7e-5, big, -big):
        for shape in ((1000,), (), (3, 7)):
            x = torch.full(shape, v, dtype=dtype)
            (codes, means), out = encode(c, x)
            assert torch.equal(out, x), (dtype, v, shape)  # one bin, whose mean is the constant
            assert codes.unique().numel() == 1 and means.count_nonzero() == int(bool(x.any()))
    (codes, means), out = encode(c, torch.empty(0, 4, dtype=dtype))
    assert out.shape == (0, 4) and out.dtype == dtype and codes.numel() == 0 and not means.any()


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_tensor_decodes_to_nan_entirely(bad):
    c = create("int8bins")
    x = randn(1000, seed=3)
    x[17] = bad
    (codes, means), out = encode(c, x)
    assert means.isnan().all() and out.isnan().all() and codes.numel() == 1000
    good = randn(1000, seed=4)  # stateless: nothing carried over
    assert torch.isfinite(encode(c, good)[1]).all() and c.state_dict() == {}


def test_extreme_finite_values_stay_finite_and_ordered():
    for x in (torch.tensor([3e38, -3e38, 1e30, 0.0, -1.0, 2e38]), torch.tensor([1e-45, 0.0, -1e-45, 3e-45, 1e-40]),
              torch.tensor([1e30, 1e30 * (1 + 2**-20), 1e30]), torch.tensor([65504.0, -65504.0, 1.0]).half()):
        (codes, _), out = encode(create("int8bins"), x)
        assert torch.isfinite(out.float()).all(), x
        assert (codes[x.float().argsort()].diff() >= 0).all(), x


def test_bad_parameters_say_how_to_fix():
    for value in ("0", "-1", "nan", "inf", "abc"):
        with pytest.raises(SpecError, match="sigmas"):
            create(f"int8bins:sigmas={value}")
    assert create("int8bins:sigmas=3").spec == "int8bins:sigmas=3.0"
    assert create("int8bins").spec == "int8bins:sigmas=6.0" and not create("int8bins").default_ef


def test_error_feedback_makes_the_sum_of_outputs_track_the_sum_of_inputs():
    """A gradient that repeats every step: without EF the same rounding error adds up step after
    step; with EF the accumulated outputs differ from the accumulated inputs by the residual only
    (compensated = transmitted + memory), which stays below a bin width at every step."""
    g = randn(5000, seed=5) + 0.05 * randn(5000, seed=6).pow(3)  # a few values in the end bins
    w = 12 * float(g.std(correction=0)) / 256
    ef, plain = create("int8bins:ef=true"), create("int8bins")
    sent_ef, sent_plain, steps = torch.zeros_like(g), torch.zeros_like(g), 60
    for step in range(1, steps + 1):
        sent_ef += encode(ef, g)[1]
        sent_plain += encode(plain, g)[1]
        assert float((sent_ef - g * step).abs().max()) < w, step  # bounded: it does not grow
    total = g * steps
    memory = ef.state_dict()["memory"]["k"][0]
    torch.testing.assert_close(sent_ef + memory, total, rtol=0, atol=1e-5 * float(total.abs().max()))
    err_ef, err_plain = float((sent_ef - total).abs().max()), float((sent_plain - total).abs().max())
    assert err_plain > 20 * err_ef, (err_plain, err_ef)  # measured: 1.6 and 0.028 (w = 0.047)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_one_pass_paths_equal_decoding_at_sizes_past_a_chunk(dtype):
    """decode_aggregate and the fused EF subtraction work CHUNK elements at a time: past one chunk,
    with a short last one, they still give the floats of decoding each payload (the generic tests
    use buckets smaller than a chunk)."""
    from gradzip.compress.int8bins import CHUNK

    n, c = 2 * CHUNK + 12_345, create("int8bins")
    payloads = [c.compress(randn(n, seed=r).mul(r + 1).to(dtype))[0] for r in range(3)]
    ctx = (torch.Size([n]), dtype)
    assert torch.equal(c.decode_aggregate(payloads, ctx), c.aggregate([c.decompress(p, ctx) for p in payloads]))
    flat = randn(n, seed=9)
    payload, fctx = c.compress(flat)
    want = flat - c.decompress(payload, fctx)
    assert c.subtract_sent(payload, fctx, flat) and torch.equal(flat, want)
