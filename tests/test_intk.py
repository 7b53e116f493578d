"""``intk``: exact payload bytes, the dense code packing, unbiased stochastic rounding, zero, constant
and non-finite tensors, deterministic draws, and convergence without error feedback. The generic
contract (shapes, dtypes, EF, state, schemes, sim = gloo = mpi) is covered by the registry-wide tests."""

from __future__ import annotations

import math

import pytest
import torch
from test_convergence import DIM, loss, make_problem, train

from gradzip.compress import create
from gradzip.compress.quantpack import pack_codes, unpack_codes
from gradzip.errors import SpecError


def encode(c, x, key="k"):
    payload, ctx = c.compress(x, key)
    return payload, c.decompress(tuple(p.clone() for p in payload), ctx)


@pytest.mark.parametrize("n,block,bits,want", [
    (1000, 256, 8, 1000 + 4 * 4), (1000, 256, 4, 500 + 16), (1000, 256, 2, 250 + 16),
    (7, 3, 2, 2 + 4 * 3), (7, 3, 4, 4 + 12), (1, 1, 4, 1 + 4), (0, 256, 8, 0), (513, 512, 2, 129 + 8),
])
def test_payload_bytes_are_exact(n, block, bits, want):
    c = create(f"intk:bits={bits},block={block}")
    assert c.payload_bytes(n) == want == math.ceil(n * bits / 8) + 4 * math.ceil(n / block)
    (codes, scales), _ = encode(c, torch.randn(n, generator=torch.Generator().manual_seed(n)))
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float32
    assert codes.numel() + 4 * scales.numel() == want


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trip_at_the_code_extremes(bits):
    top = (1 << bits) - 1
    for n in (1, 3, 8, 9, 17):
        codes = torch.tensor([0, top, 2 * ((1 << (bits - 1)) - 1), 1] * n, dtype=torch.uint8)[:n]
        packed = pack_codes(codes, bits)
        assert packed.numel() == math.ceil(n * bits / 8)
        assert torch.equal(unpack_codes(packed, n, bits), codes.to(torch.int32))
    # Little-endian within a byte: element j of a byte sits at bits [j*bits, (j+1)*bits).
    assert pack_codes(torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8), 2).tolist() == [1 | 2 << 2 | 3 << 4, 3]
    # +-scale encode to the extreme codes 2L and 0 and decode exactly.
    L = (1 << (bits - 1)) - 1
    x = torch.tensor([2.5, -2.5, 0.0, 2.5, -2.5])
    (packed, scale), out = encode(create(f"intk:bits={bits}"), x)
    assert unpack_codes(packed, 5, bits).tolist() == [2 * L, 0, L, 2 * L, 0] and scale.tolist() == [2.5]
    assert torch.equal(out, x)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_stochastic_rounding_is_unbiased(bits):
    """The mean of N decodes (advancing counters) is within 6 standard errors of x elementwise
    (measured: under 3); the rounding variance is at most step^2/4, step = scale / L. Fixed seeds."""
    N, L = 1500, (1 << (bits - 1)) - 1
    x = torch.randn(300, generator=torch.Generator().manual_seed(bits))
    c = create(f"intk:bits={bits},block=64")
    mean = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(N):
        mean += encode(c, x)[1].double() / N
    step = encode(c, x)[0][1].max() / L  # the largest step of the 5 blocks (their scales / L)
    err = (mean - x.double()).abs().max()
    assert err < 6 * step / (2 * math.sqrt(N)), (err, step)
    one = (encode(c, x)[1] - x).abs().max()
    assert one > 10 * err  # a single decode is far coarser: the average really cancels its noise
    assert c.state_dict() == {"counters": {"k": N + 2}}


def test_zero_and_constant_tensors():
    for bits in (2, 4, 8):
        c = create(f"intk:bits={bits},block=5")
        (_, scales), out = encode(c, torch.zeros(12))
        assert torch.equal(out, torch.zeros(12)) and torch.equal(scales, torch.zeros(3))
        for v in (-3.25, 1e-30, 7e37):
            x = torch.full((12,), v)
            assert torch.equal(encode(c, x)[1], x), (bits, v)  # |x| = scale: the extreme code, exactly
        x = torch.full((12,), 0.5, dtype=torch.float16)
        assert torch.equal(encode(c, x)[1], x)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_block_decodes_to_nan_and_the_rest_survives(bad):
    c = create("intk:bits=4,block=4")
    x = torch.arange(12.0) - 6
    x[5] = bad
    (_, scales), out = encode(c, x)
    assert not math.isfinite(float(scales[1])) and torch.isfinite(scales[[0, 2]]).all()
    assert out[4:8].isnan().all() and torch.isfinite(out[[*range(4), *range(8, 12)]]).all()
    good = torch.ones(12)
    assert torch.equal(encode(c, good)[1], good)  # nothing carried over
    assert c.state_dict() == {"counters": {"k": 2}}


def test_draws_are_deterministic_fresh_per_step_and_per_input():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    a, b = create("intk:bits=2"), create("intk:bits=2")
    first = encode(a, x)[0][0]
    assert torch.equal(first, encode(b, x)[0][0])  # another rank, or a rerun: the same draw
    assert not torch.equal(first, encode(a, x)[0][0])  # the counter advanced
    assert not torch.equal(first, encode(create("intk:bits=2"), x, key="other")[0][0])
    assert not torch.equal(first, encode(create("intk:bits=2,seed=1"), x)[0][0])
    y = x.clone()
    y[0] = y[0].nextafter(torch.tensor(math.inf))  # one bit of the input: an independent draw
    assert (encode(create("intk:bits=2"), y)[0][0] != first).sum() > 50
    b.load_state_dict(a.state_dict())
    assert torch.equal(encode(a, x)[0][0], encode(b, x)[0][0])


def test_bad_parameters_say_how_to_fix():
    for spec, word in (("intk:bits=3", "bits=2, bits=4 or bits=8"), ("intk:block=0", "block=256")):
        with pytest.raises(SpecError, match=word):
            create(spec)


@pytest.mark.timeout(60)
def test_converges_without_error_feedback():
    """Unbiased, so plain GD converges near the optimum without EF, where biased codes stall
    (tests/test_convergence.py: onebit:ef=false ~0.09). Measured: bits=2 ~4e-4 (bits=4 ~7e-6, bits=8
    ~3e-8: the noise floor shrinks with the step). The coarsest code only, to keep the test short."""
    A, b = make_problem()
    x_star = torch.linalg.lstsq(torch.cat(A), torch.cat(b)).solution
    f_star, f0 = loss(A, b, x_star), loss(A, b, torch.zeros(DIM, dtype=torch.float64))
    subopt = (loss(A, b, train("intk:bits=2", A, b)) - f_star) / (f0 - f_star)
    assert subopt < 5e-3, f"intk:bits=2: suboptimality {subopt:.2e}, expected near the optimum"
