"""Property-based tests (hypothesis) of the compressor contract, over the whole registry: random
bucket shapes, dtypes and values, including ±0, subnormals, ±inf and NaN.

- round trip: decoding gives the bucket's shapes and dtypes; lossless compressors give it back
  exactly; finite inputs give finite outputs;
- payload bytes: the tensors on the wire are exactly ``batch_payload_bytes`` (every round);
- error feedback: compensated = transmitted + memory, to rounding, for finite inputs;
- a non-finite input never poisons state: after one bucket with NaN/inf, the next finite bucket
  decodes to finite values and every state tensor is finite.

Every bucket goes through the real Exchange over a one-worker SimWorld, as the engine runs it.

The default profile is derandomized (the same examples on every run and machine: the suite must
not flake); ``GRADZIP_HYPOTHESIS=explore python -m pytest tests/test_properties.py`` searches
500 fresh random examples per test.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradzip.comm.sim import SimWorld
from gradzip.compress import create, registry
from gradzip.engine.exchange import Exchange

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SPECS = sorted({create(s).spec for name, cls in registry().items()
                for s in (name, f"{name}:ef=true", f"{name}:ef=false") + ((f"{name}:ef=ef21",) if cls.biased else ())})
settings.register_profile("gradzip-ci", max_examples=25, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SETTINGS = settings.get_profile(os.environ.get("GRADZIP_HYPOTHESIS", "gradzip-ci"))

shapes = st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple), min_size=1, max_size=3)
SPECIAL = [0.0, -0.0, 1e-40, -1e-40, 5e-324, 1e-8, 65504.0, 1e30]


def _bucket(draw, shape_list, dtype, special: bool) -> list[torch.Tensor]:
    out = []
    for shape in shape_list:
        n = math.prod(shape)
        values = draw(st.lists(st.one_of(st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False),
                                         st.sampled_from(SPECIAL)), min_size=n, max_size=n))
        t = torch.tensor(values, dtype=torch.float64).reshape(shape)
        if special and n:
            idx = draw(st.integers(0, n - 1))
            t.view(-1)[idx] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        out.append(t.to(dtype))
    return out


@st.composite
def buckets(draw, special: bool = False):
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    return _bucket(draw, draw(shapes), dtype, special)


def exchange(c, tensors, key="b") -> tuple[list[torch.Tensor], int]:
    """One step through the Exchange on one worker: (averaged tensors, payload bytes sent)."""
    world = SimWorld(1)
    comm = world.comms[0]
    ex = Exchange(c, comm, [t.clone() for t in tensors], key)
    sent = []
    launch = ex._launch  # count the payload tensors of every round as they are launched

    def counting(payload):
        sent.append(sum(p.numel() * p.element_size() for p in payload))
        launch(payload)

    ex._launch = counting  # type: ignore[method-assign]
    ex.start()
    while not ex.advance():
        pass
    return ex.result(), sum(sent)


def state_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in state_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in state_tensors(v)]
    return []


@pytest.mark.parametrize("spec", SPECS)
@SETTINGS
@given(tensors=buckets())
def test_round_trip_shapes_dtypes_bytes_and_finiteness(spec, tensors):
    c = create(spec)
    out, sent = exchange(c, tensors)
    assert [(o.shape, o.dtype) for o in out] == [(t.shape, t.dtype) for t in tensors]
    bound = c.batch_payload_bytes([t.shape for t in tensors], tensors[0].dtype)
    assert sent == bound if c.fixed_size else sent <= bound  # data-dependent sizes: an upper bound
    finite_in = all(bool(torch.isfinite(t.float()).all()) for t in tensors)
    # Within range: fp16 overflows above 65504 by design, and random-k's unbiased n/k scaling
    # (at most the bucket's size here) must stay below that too.
    numel = sum(t.numel() for t in tensors)
    in_range = all(float(t.float().abs().max()) * max(1, numel) < 6e4 for t in tensors if t.numel()) \
        or tensors[0].dtype != torch.float16
    if finite_in and in_range and c.name != "fp16":
        assert all(bool(torch.isfinite(o.float()).all()) for o in out), spec
    if c.lossless and not spec.endswith("ef=true"):
        for o, t in zip(out, tensors):
            assert torch.equal(o, t) or (torch.isnan(o) == torch.isnan(t)).all()


@pytest.mark.parametrize("spec", [s for s in SPECS if s.endswith("ef=true")])
@SETTINGS
@given(tensors=buckets())
def test_error_feedback_invariant(spec, tensors):
    """compensated (the gradient, memory zero at first) == transmitted + new memory. The
    transmitted part is what this rank contributed: with one worker, the averaged result."""
    c = create(spec)
    if not all(bool(torch.isfinite(t.float()).all()) for t in tensors):
        return
    out, _ = exchange(c, tensors)
    memory = c.memory["b"]
    # The output is cast to the gradient's dtype (the invariant holds in fp32, before that cast):
    # allow that rounding, relative to the largest value in the bucket.
    scale = 1.0 + max([float(x.float().abs().max()) for x in [*tensors, *out] if x.numel()] or [0.0])
    numel = sum(t.numel() for t in tensors)
    for t, o, m in zip(tensors, out, memory):
        if (c.name == "fp16" or t.dtype == torch.float16) and float(t.float().abs().max()) * numel >= 6e4:
            continue  # the fp16 cast (or random-k's n/k scaling before it) leaves fp16's range
        torch.testing.assert_close(o.float() + m, t.float(), rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("spec", SPECS)
@SETTINGS
@given(bad=buckets(special=True))
def test_a_non_finite_bucket_never_poisons_state(spec, bad):
    c = create(spec)
    exchange(c, bad)
    good = [torch.ones_like(t) for t in bad]
    out, _ = exchange(c, good)
    assert all(bool(torch.isfinite(o.float()).all()) for o in out), f"{spec}: NaN/inf carried into the next step"
    assert all(bool(torch.isfinite(t.float()).all()) for t in state_tensors(c.state_dict())), f"{spec}: state poisoned"
