"""PowerSGD: exactness at full rank, convergence to the best rank-r approximation, batching, the
uncompressed path, state round trip, and the multi-worker step against a direct reference."""

from __future__ import annotations

import pytest
import torch

from gradzip.comm.sim import SimWorld
from gradzip.compress import create
from gradzip.compress._linalg import orthonormalize
from gradzip.compress.ef import ErrorFeedback
from gradzip.engine.exchange import Exchange
from gradzip.errors import SpecError


def step(c, tensors, key="k"):
    """One single-worker step (the mean over one rank is the rank's own payload)."""
    payload, ctx = c.compress_batch(tensors, key)
    sent = [payload]
    for _ in range(1, c.rounds):
        payload, ctx = c.next_round_batch(payload, ctx)
        sent.append(payload)
    return c.decompress_batch(payload, ctx), sent


def sim_step(comps, grads, key="k"):
    world = SimWorld(len(comps))
    exs = [Exchange(c, world[w], g, key) for w, (c, g) in enumerate(zip(comps, grads))]
    for e in exs:
        e.start()
    while not all([e.advance() for e in exs]):  # a list: every worker advances each round
        pass
    return [e.result() for e in exs]


def low_rank_spectrum(n, m, gen, decay=0.8):
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(m, m, generator=gen))
    s = decay ** torch.arange(min(n, m), dtype=torch.float32)
    return (u[:, : len(s)] * s) @ v[:, : len(s)].T, s


@pytest.mark.parametrize("shape", [(12, 7), (7, 12), (6, 2, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_full_rank_recovers_matrix(shape, dtype):
    c = create("powersgd:rank=16,ef=false,min_compression_rate=0")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (out,), _ = step(c, [x])
    assert out.shape == x.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), x.float(), atol=tol, rtol=tol)


def test_warm_start_reaches_best_rank_r_error():
    gen = torch.Generator().manual_seed(0)
    m, s = low_rank_spectrum(64, 48, gen)
    best = s[4:].square().sum().sqrt()  # Eckart–Young: error of the best rank-4 approximation
    c = create("powersgd:rank=4,ef=false")
    errs = [float((step(c, [m.clone()])[0][0] - m).norm()) for _ in range(10)]
    assert errs[0] > 1.05 * best  # a random start is not yet optimal...
    assert errs[-1] <= 1.01 * best  # ...the warm-started power iteration gets there
    cold = create("powersgd:rank=4,ef=false,warm_start=false")
    cold_errs = [float((step(cold, [m.clone()])[0][0] - m).norm()) for _ in range(10)]
    assert min(cold_errs) > 1.05 * best  # without warm start every step starts from scratch


def test_batching_by_shape_matches_unbatched():
    gen = torch.Generator().manual_seed(2)
    flat = torch.randn(2 * (30 * 20 + 5), generator=gen)  # two weights (and a bias gap) in one bucket
    mats = [flat[:600].view(30, 20), flat[605:1205].view(30, 20),  # zero-copy strided batch
            torch.randn(20, 30, generator=gen).T,  # non-contiguous: copied
            torch.randn(30, 20, generator=gen).to(torch.bfloat16)]  # other dtype: copied
    batched = create("powersgd:rank=3,ef=false")
    single = [create("powersgd:rank=3,ef=false") for _ in mats]
    for _ in range(3):  # warm-started steps
        out, _ = step(batched, mats)
        for c, x, o in zip(single, mats, out):
            (ref,), _ = step(c, [x])
            assert o.dtype == x.dtype
            torch.testing.assert_close(o.float(), ref.float(), atol=1e-5, rtol=1e-5)


def test_small_and_1d_tensors_go_uncompressed_and_exact():
    gen = torch.Generator().manual_seed(3)
    shapes = [(64, 64), (4, 3), (10,), (), (1,), (0,), (0, 5), (3, 1, 1), (1, 100)]
    xs = [torch.randn(s, generator=gen) for s in shapes]
    c = create("powersgd:rank=4,ef=false")
    out, sent = step(c, xs)
    assert [len(p) for p in sent] == [1, 2]  # fixed payload structure: (P,), then (Q, uncompressed)
    assert sum(t.numel() * t.element_size() for p in sent for t in p) == c.batch_payload_bytes(shapes)
    assert c.payload_bytes((64, 64)) == (64 + 64) * 4 * 4
    for s, x, o in zip(shapes, xs, out):
        assert o.shape == x.shape
        if s != (64, 64):
            assert torch.equal(o, x), s
            assert c.payload_bytes(s) == x.numel() * 4
    assert not torch.allclose(out[0], xs[0], atol=1e-3)  # rank 4 of a random 64x64 is lossy
    # The threshold is n*m / ((n+m)*r): 8 for a 64x64 at rank 4.
    assert create("powersgd:min_compression_rate=8").payload_bytes((64, 64)) == 128 * 4 * 4
    assert create("powersgd:min_compression_rate=8.01").payload_bytes((64, 64)) == 64 * 64 * 4


@pytest.mark.parametrize("spec", ["powersgd:rank=2", "powersgd:rank=2,warm_start=false"])
def test_state_dict_round_trip(tmp_path, spec):
    gen = torch.Generator().manual_seed(4)
    grads = [[torch.randn(16, 12, generator=gen), torch.randn(12, generator=gen)] for _ in range(3)]
    a = create(spec)  # EF on by default: the memory is part of the state
    assert isinstance(a, ErrorFeedback)
    for g in grads[:2]:
        step(a, g)
    torch.save(a.state_dict(), tmp_path / "state.pt")
    b = create(spec)
    b.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    out_a, _ = step(a, grads[2])
    out_b, _ = step(b, grads[2])
    assert all(torch.equal(x, y) for x, y in zip(out_a, out_b))
    fresh, _ = step(create(spec), grads[2])
    assert not torch.equal(fresh[0], out_a[0])  # the state mattered


@pytest.mark.parametrize("ef", [False, True])
def test_sim_average_matches_reference_step(ef):
    """4 workers through Exchange + SimWorld equal one PowerSGD step computed directly on the mean."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(32, 24), (32, 24), (24,), (16, 40)]
    comps = [create(f"powersgd:rank=2,ef={str(ef).lower()}") for _ in range(4)]
    for _ in range(2):  # the first step gives every worker its warm-start Q (and EF memory)
        grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
        states = [c.state_dict() for c in comps]
        results = sim_step(comps, grads)
    for r in results[1:]:  # every worker ends with the same average
        assert all(torch.equal(x, y) for x, y in zip(r, results[0]))
    # Before the last step: the shared Q, and each worker's compensated gradient (grad + memory).
    q = (states[0]["inner"] if ef else states[0])["q"]
    comp = [[g + m for g, m in zip(grads[w], states[w]["memory"]["k"])] if ef else grads[w] for w in range(4)]
    mean = [torch.stack([c[i] for c in comp]).mean(0) for i in range(len(shapes))]
    for i, (qkey, j) in {0: ("k/32x24", 0), 1: ("k/32x24", 1), 3: ("k/16x40", 0)}.items():
        p = orthonormalize((mean[i] @ q[qkey][j]).unsqueeze(0))[0]  # allreduced P, orthonormalised
        torch.testing.assert_close(results[0][i], p @ (mean[i].T @ p).T, atol=1e-5, rtol=1e-4)
        if ef:  # each worker keeps what its own factors did not carry: M_w - P Pᵀ M_w
            for w in range(4):
                resid = comp[w][i] - p @ (p.T @ comp[w][i])
                torch.testing.assert_close(comps[w].memory["k"][i], resid, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(results[0][2], mean[2])  # the bias travels exactly...
    if ef:
        assert all(torch.equal(c.memory["k"][2], torch.zeros(24)) for c in comps)  # ...and leaves no residual


def test_residual_against_the_reduced_result():
    """residual=reduced: each worker keeps M_w − (what reached the gradients), P Q_reducedᵀ, as
    Vogels et al.'s code and torch's powerSGD_hook do; exact tensors leave no residual; the mean
    residual over workers equals residual=local's; one rank gives local's floats bit for bit."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(32, 24), (24,), (16, 40)]
    local = [create("powersgd:rank=2") for _ in range(3)]
    reduced = [create("powersgd:rank=2,residual=reduced") for _ in range(3)]
    assert reduced[0].residual_from_output and not local[0].residual_from_output
    for _ in range(3):
        grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
        before = [[g + m for g, m in zip(grads[w], c.residuals("k") or [torch.zeros(s) for s in shapes])]
                  for w, c in enumerate(reduced)]
        sim_step(local, [[g.clone() for g in gs] for gs in grads])
        out_r = sim_step(reduced, [[g.clone() for g in gs] for gs in grads])
        for w, c in enumerate(reduced):
            mem = c.residuals("k")
            for i in (0, 2):
                torch.testing.assert_close(mem[i], before[w][i] - out_r[w][i], atol=1e-6, rtol=1e-5)
            assert torch.equal(mem[1], torch.zeros(24))
        for i in (0, 2):
            mean_l = torch.stack([c.residuals("k")[i] for c in local]).mean(0)
            mean_r = torch.stack([c.residuals("k")[i] for c in reduced]).mean(0)
            torch.testing.assert_close(mean_l, mean_r, atol=1e-5, rtol=1e-4)
    assert not all(torch.equal(a.residuals("k")[0], b.residuals("k")[0]) for a, b in zip(local, reduced))
    one_l, one_r = create("powersgd:rank=2"), create("powersgd:rank=2,residual=reduced")
    for _ in range(3):
        g = [torch.randn(s, generator=gen) for s in shapes]
        a, b = step(one_l, [t.clone() for t in g]), step(one_r, [t.clone() for t in g])
        assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
        assert all(torch.equal(x, y) for x, y in zip(one_l.residuals("k"), one_r.residuals("k")))
    with pytest.raises(SpecError, match="residual must be 'local' or 'reduced'"):
        create("powersgd:residual=global")


def test_recovers_after_zero_and_non_finite_gradients():
    gen = torch.Generator().manual_seed(7)
    m, s = low_rank_spectrum(40, 30, gen)
    c = create("powersgd:rank=4,ef=false")
    step(c, [torch.zeros(40, 30)])
    bad = m.clone()
    bad[3, 4] = float("nan")
    bad[5, 6] = float("inf")
    step(c, [bad])  # e.g. an fp16 overflow step that the GradScaler skips
    errs = [float((step(c, [m.clone()])[0][0] - m).norm()) for _ in range(10)]
    assert errs[-1] <= 1.01 * s[4:].square().sum().sqrt()  # warm start is not poisoned


def test_bad_config_is_a_spec_error():
    with pytest.raises(SpecError, match=r"rank must be an integer >= 1"):
        create("powersgd:rank=0")
    with pytest.raises(SpecError, match="min_compression_rate"):
        create("powersgd:min_compression_rate=-1")


def test_orthonormalize_is_stable_for_ill_conditioned_rank_32():
    gen = torch.Generator().manual_seed(6)
    u, _ = torch.linalg.qr(torch.randn(3, 512, 32, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(3, 32, 32, generator=gen))
    p = u @ torch.diag(torch.logspace(0, -6, 32)) @ v  # condition number 1e6
    basis = orthonormalize(p)
    eye = torch.eye(32).expand(3, 32, 32)
    torch.testing.assert_close(basis.transpose(1, 2) @ basis, eye, atol=1e-5, rtol=0)
    torch.testing.assert_close(basis @ (basis.transpose(1, 2) @ p), p, atol=1e-5, rtol=1e-4)  # same span
    zero = orthonormalize(torch.zeros(1, 8, 2))  # a zero gradient still gives orthonormal columns
    torch.testing.assert_close(zero.transpose(1, 2) @ zero, torch.eye(2).unsqueeze(0))
