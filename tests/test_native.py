"""The fused C kernels (gradzip.compress.native, and DiLoCo's outer step in gradzip.engine.outer_step)
give the same bits as the numpy/torch path they replace, and gradzip falls back to that path, saying
why, when they cannot be built."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.compress import create, native
from gradzip.compress.bitpack import pack_signs, sum_signs
from gradzip.compress.select import _at_least, topk_indices
from gradzip.engine import outer_step

needs_kernels = pytest.mark.skipif(native.lib() is None, reason=native.status())


@contextlib.contextmanager
def numpy_path() -> Iterator[None]:
    """Run the block with the kernels switched off (as GRADZIP_NATIVE=0 does)."""
    saved = native._lib, native._why, native._tried
    native._lib, native._why, native._tried = None, "off for this test", True
    try:
        yield
    finally:
        native._lib, native._why, native._tried = saved


def bits(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint32 if t.dtype == torch.float32 else np.uint8)


def awkward(n: int, seed: int) -> torch.Tensor:
    """Random floats with ±0, ±inf, NaN and subnormals mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40])
    pos = torch.randint(0, max(n, 1), (min(n, 7),), generator=g)
    x[pos] = special[:pos.numel()]
    return x


@needs_kernels
@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 200), seed=st.integers(0, 2**16), scale=st.floats(0, 10, width=32))
def test_sign_pack_sub_is_pack_then_subtract_bit_for_bit(n, seed, scale):
    x = awkward(n, seed)
    ref = x.clone()
    ref_packed = pack_signs(ref)
    ref.sub_(torch.copysign(torch.tensor(scale), ref))
    packed = native.sign_pack_sub(x, scale)
    assert packed is not None and torch.equal(packed, ref_packed)
    assert (bits(x) == bits(ref)).all()
    # without a scale, it only packs
    y = awkward(n, seed)
    assert torch.equal(native.sign_pack_sub(y, None), ref_packed) and (bits(y) == bits(awkward(n, seed))).all()


@needs_kernels
@pytest.mark.parametrize("n,ranks", [(1, 1), (13, 3), (4096 + 5, 8), (1 << 17, 4), (40_000 + 3, 6), (999, 9),
                                     (2 * 16384 + 29, 17)])  # 3 groups of ranks over 3 blocks
def test_sum_signs_kernel_matches_the_table_path(n, ranks):
    g = torch.Generator().manual_seed(n)
    packeds = [pack_signs(torch.randn(n, generator=g)) for _ in range(ranks)]
    scales = [torch.rand(1, generator=g) * 3 for _ in range(ranks)]
    scales[0] = torch.zeros(1)  # a zero scale gives ±0
    for divisor in (1, ranks):
        got = sum_signs(packeds, n, scales, torch.float32, divisor=divisor)
        with numpy_path():
            ref = sum_signs(packeds, n, scales, torch.float32, divisor=divisor)
        assert (bits(got) == bits(ref)).all()


@needs_kernels
@pytest.mark.parametrize("n", [7, 1000, (1 << 16) + 3])
def test_at_least_kernel_matches_numpy(n):
    x = awkward(n, n)
    keys = x.view(torch.int32).numpy()
    for thr in (0, int(keys[0] & 0x7fffffff), 0x3f800000, 0x7f800000, 0x7fffffff):
        got = _at_least(keys, np.int32(thr), 0x7fffffff)
        with numpy_path():
            ref = _at_least(keys, np.int32(thr), 0x7fffffff)
        assert np.array_equal(got, ref)
    with numpy_path():
        ref = topk_indices(x, n // 100 + 1)
    assert torch.equal(topk_indices(x, n // 100 + 1), ref)


@needs_kernels
@pytest.mark.parametrize("spec", ["onebit", "topk:ratio=0.01,ef=true", "signsgd:ef=true", "natural:ef=true"])
def test_error_feedback_is_the_same_with_and_without_kernels(spec):
    """Payloads, decodes and residuals over several steps, with a non-finite step in between."""
    def run() -> list[torch.Tensor]:
        comp = create(spec)
        g = torch.Generator().manual_seed(3)
        seen = []
        for step in range(4):
            grads = [torch.randn(300, 7, generator=g), torch.randn(1000, generator=g)]
            if step == 2:
                grads[1][5] = float("inf")
            payload, ctx = comp.compress_batch(grads, "b")
            seen += [t for t in payload if isinstance(t, torch.Tensor)]
            seen += comp.decompress_batch(payload, ctx)
            seen += [r.clone() for r in comp.residuals("b")]
            agg = comp.decode_aggregate_batch([payload, payload], ctx)
            seen += agg or []
        return seen

    fast = run()
    with numpy_path():
        ref = run()
    assert len(fast) == len(ref)
    for a, b in zip(fast, ref):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert all(torch.isfinite(r).all() for r in fast[-3:])


def test_disabled_and_unbuildable_kernels_fall_back_and_say_why(monkeypatch, tmp_path):
    saved = native._lib, native._why, native._tried
    try:
        monkeypatch.setenv("GRADZIP_NATIVE", "0")
        native.reset()
        assert native.lib() is None and "disabled by GRADZIP_NATIVE=0" in native.status()
        monkeypatch.delenv("GRADZIP_NATIVE")
        monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path))  # nothing cached there
        monkeypatch.setenv("CC", "no-such-cc")
        native.reset()
        assert native.lib() is None and "no C compiler ('no-such-cc'" in native.status()
        assert not list(tmp_path.rglob("*.so"))
        # the callers keep working on the numpy/torch path
        x = torch.randn(100)
        payload, ctx = create("onebit").compress_batch([x], "k")
        assert payload[0].numel() == 13
    finally:
        native._lib, native._why, native._tried = saved


@pytest.mark.skipif(native.lib() is None, reason=native.status())
def test_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    saved = native._lib, native._why, native._tried
    try:
        monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path))
        native.reset()
        assert native.lib() is not None
        built = list((tmp_path / "native").glob("kernels-*.so"))
        assert len(built) == 1 and not list((tmp_path / "native").glob(".kernels-*"))  # no temp left
        mtime = built[0].stat().st_mtime_ns
        native.reset()
        assert native.lib() is not None and built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt
    finally:
        native._lib, native._why, native._tried = saved


@needs_kernels
@pytest.mark.parametrize("n", [1, 63, 64 * 3 + 5, 100_003])
def test_kernels_split_over_threads_give_the_same_bits(n, monkeypatch):
    """With several intra-op threads each kernel runs on ranges in parallel: the same results."""
    def all_three() -> list[torch.Tensor]:
        x = awkward(n, 7)
        packed = native.sign_pack_sub(x, 0.5)
        out = native.sum_signs([packed, pack_signs(awkward(n, 8))], [0.5, 2.0], 2.0)
        assert out is not None and out.numel() == 8 * packed.numel()
        idx = native.at_least(awkward(n, 9).view(torch.int32), 0x3f000000)
        return [x, packed, out, idx]

    one = all_three()
    threads = torch.get_num_threads()
    monkeypatch.setattr(native, "PARALLEL_MIN", 8)
    try:
        torch.set_num_threads(3)
        parts = native.ranges(n, 64)
        assert len(parts) <= 3 and (len(parts) > 1) == (n > 64) and parts[-1][1] == n
        many = all_three()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, many):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@needs_kernels
@pytest.mark.parametrize("scale", [0.0, 0.37, 3e38, float("inf")])
def test_decode_kernel_matches_the_table_path(scale):
    from gradzip.compress.bitpack import unpack_signs

    packed = pack_signs(awkward(1003, 5))
    got = unpack_signs(packed, 1003, torch.tensor(scale), torch.float32)
    with numpy_path():
        ref = unpack_signs(packed, 1003, torch.tensor(scale), torch.float32)
    assert got.shape == (1003,) and (bits(got) == bits(ref)).all()


@needs_kernels
@pytest.mark.parametrize("ranks", [3, 4, 8])
def test_majority_vote_decode_kernel_matches_the_table_path(ranks):
    from gradzip.compress.bitpack import majority_signs, unpack_votes

    g = torch.Generator().manual_seed(ranks)
    negative, tie = majority_signs([pack_signs(torch.randn(2001, generator=g)) for _ in range(ranks)])
    got = unpack_votes(negative, tie, 2001, torch.tensor(0.25), torch.float32)
    with numpy_path():
        ref = unpack_votes(negative, tie, 2001, torch.tensor(0.25), torch.float32)
    assert got.shape == (2001,) and (bits(got) == bits(ref)).all()
    assert (tie is None) == (ranks % 2 == 1) and (ranks % 2 == 1 or (got == 0).any())


@needs_kernels
@pytest.mark.parametrize("ranks", [1, 2, 7, 8])
def test_vote_counted_and_decoded_in_one_pass_matches_majority_signs(ranks):
    from gradzip.compress.bitpack import majority_signs, unpack_votes

    g = torch.Generator().manual_seed(ranks)
    n = 5 * 2048 * 8 + 13  # several blocks and a ragged end
    packeds = [pack_signs(torch.randn(n, generator=g)) for _ in range(ranks)]
    out = native.majority_decode(packeds, 0.75)
    assert out is not None
    with numpy_path():
        ref = unpack_votes(*majority_signs(packeds), n, torch.tensor(0.75), torch.float32)
    assert (bits(out[:n]) == bits(ref)).all()
    assert native.majority_decode(packeds * 256, 0.75) is None  # too many ranks


def _kernel_in_child(q) -> None:
    q.put(bool(native.sign_pack_sub(torch.ones(1000), 1.0) is not None))


@needs_kernels
@pytest.mark.timeout(60)
def test_a_forked_child_runs_the_threaded_kernels(monkeypatch):
    """The parent's thread pool does not survive fork: the child starts its own instead of hanging."""
    import multiprocessing as mp

    threads = torch.get_num_threads()
    monkeypatch.setattr(native, "PARALLEL_MIN", 8)
    try:
        torch.set_num_threads(2)
        native.sign_pack_sub(torch.ones(1000), 1.0)  # the parent's pool exists now
        assert native._pool is not None
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_kernel_in_child, args=(q,))
        p.start()
        p.join(30)
        assert p.exitcode == 0 and q.get(timeout=5) is True
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86 flags")
def test_scalar_paths_of_a_build_without_avx2_give_the_same_bits(monkeypatch, tmp_path):
    """CPUs without AVX2 run the kernels' scalar loops: build for baseline x86-64 and compare."""
    def everything() -> list[torch.Tensor]:
        from gradzip.compress.bitpack import majority_signs, unpack_votes

        n = 3 * 2048 * 8 + 29
        x = awkward(n, 11)
        packed = native.sign_pack_sub(x, 0.3)
        codes = [pack_signs(awkward(n, s)) for s in range(6)]
        total = native.sum_signs(codes, [0.5, 1.5, 0.25, 2.0, 3.0, 0.125], 6.0)
        vote = native.majority_decode(codes, 0.5)
        assert total is not None and vote is not None
        votes = unpack_votes(*majority_signs(codes), n, torch.tensor(0.5), torch.float32)
        idx = native.at_least(awkward(n, 12).view(torch.int32), 0x3f000000)
        return [x, packed, total[:n], vote[:n], votes, idx]

    saved = native._lib, native._why, native._tried
    try:
        fast = everything()
        monkeypatch.setattr(native, "_FLAGS", [f if f != "-march=native" else "-march=x86-64" for f in native._FLAGS])
        monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path))
        native.reset()
        assert native.lib() is not None, native.status()
        plain = everything()
    finally:
        native._lib, native._why, native._tried = saved
    for a, b in zip(fast, plain):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


needs_outer = pytest.mark.skipif(not outer_step.outer_sgd_ready(), reason="the outer-step kernel needs the kernels "
                                 "built with FMA and torch on its AVX2/AVX-512 CPU kernels")
SGD_CONFIGS = [dict(lr=0.7, momentum=0.9, nesterov=True), dict(lr=1.0), dict(lr=0.5, momentum=0.8, dampening=0.1),
               dict(lr=0.3, momentum=0.9, nesterov=True, weight_decay=0.01), dict(lr=0.2, momentum=0.5)]


@needs_outer
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("config", SGD_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_outer_sgd_kernel_is_torch_sgd_bit_for_bit(config, threads, monkeypatch):
    """gz_outer_sgd's one pass gives step()'s parameters and momentum buffers, and copies them into
    every target; sizes with vector tails, split over threads."""
    monkeypatch.setattr(native, "PARALLEL_MIN", 1000)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in (1, 15, 16 * 1000 + 7):
            p = torch.nn.Parameter(awkward(n, 3).nan_to_num(0.0, 1e30, -1e30))
            opt = torch.optim.SGD([p], **config)
            theta, targets = p.detach().clone(), [torch.zeros(n), torch.zeros(n)]
            buf = torch.empty(n) if opt.param_groups[0]["momentum"] else None
            for step in range(3):
                grad = torch.randn(n, generator=torch.Generator().manual_seed(step))
                p.grad = grad.clone()
                opt.step()
                kept = grad.clone()
                scalars = outer_step.sgd_scalars(opt.param_groups[0])
                assert outer_step.outer_sgd(theta, grad, buf, scalars, step == 0, targets)
                assert torch.equal(grad, kept)  # the gradient is read, not written
                assert (bits(theta) == bits(p.detach())).all()
                assert all((bits(t) == bits(theta)).all() for t in targets)
                if buf is not None:
                    assert (bits(buf) == bits(opt.state[p]["momentum_buffer"])).all()
    finally:
        torch.set_num_threads(saved)


@needs_outer
def test_outer_sgd_kernel_refuses_what_it_cannot_take():
    scalars = outer_step.sgd_scalars(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0).param_groups[0])
    x = torch.zeros(8)
    assert not outer_step.outer_sgd(x, torch.zeros(7), None, scalars, False, [])  # sizes differ
    assert not outer_step.outer_sgd(x, torch.zeros(8, dtype=torch.float64), None, scalars, False, [])
    assert not outer_step.outer_sgd(x, torch.zeros(16)[::2], None, scalars, False, [])  # not contiguous
    with numpy_path():
        assert not outer_step.outer_sgd_ready()


@needs_kernels
@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_sub_finite_is_sub_then_nan_to_num_bit_for_bit(n, seed):
    m, t = awkward(n, seed), awkward(n, seed + 1)
    ref = m.clone().sub_(t).nan_to_num_(0.0, 0.0, 0.0)
    assert native.sub_finite(m, t)
    assert (bits(m) == bits(ref)).all()
    assert not native.sub_finite(m, t[:-1] if n else torch.zeros(1))  # sizes differ: nothing done
    assert not native.sub_finite(m.double(), t.double())


@needs_kernels
@pytest.mark.parametrize("residual", ["local", "reduced"])
def test_powersgd_error_feedback_is_the_same_with_and_without_kernels(residual):
    """Both rounds, one rank (the reduced payload is its own), a step with an inf in between: the
    fused subtraction and guard leave the bits of sub_ then nan_to_num_."""
    def run() -> list[torch.Tensor]:
        comp = create(f"powersgd:rank=2,residual={residual}")
        g = torch.Generator().manual_seed(5)
        seen = []
        for step in range(4):
            grads = [torch.randn(60, 7, generator=g), torch.randn(100, generator=g), torch.randn(40, 30, generator=g)]
            if step == 2:
                grads[0][3, 4] = float("inf")
                grads[1][5] = float("nan")
            payload, ctx = comp.compress_batch(grads, "b")
            payload, ctx = comp.next_round_batch(payload, ctx)
            seen += comp.decompress_batch(payload, ctx)
            seen += [r.clone() for r in comp.residuals("b")]
        return seen

    fast = run()
    with numpy_path():
        ref = run()
    for a, b in zip(fast, ref):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert all(torch.isfinite(r).all() for r in fast[-3:])


def test_encoding_a_sign_leaves_numpy_and_scipy_blas_on_one_thread():
    """mean_abs's BLAS sum runs single-threaded (idle OpenBLAS threads busy-wait and took a core
    from torch); torch's own threads are left alone."""
    from threadpoolctl import threadpool_info

    from gradzip.compress.bitpack import mean_abs

    threads = torch.get_num_threads()
    x = torch.randn(5000)
    assert mean_abs(x).item() == pytest.approx(x.abs().mean().item(), rel=1e-5)
    blas = [i for i in threadpool_info() if i["user_api"] == "blas" and "torch" not in i["filepath"]]
    assert blas and all(i["num_threads"] == 1 for i in blas)
    assert torch.get_num_threads() == threads
