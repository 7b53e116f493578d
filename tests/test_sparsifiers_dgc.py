"""``dgc``, ``threshold`` and ``signum``: what the generic tests (tests/test_compressors.py and
friends) cannot see. DGC's warm-up schedule, momentum factor masking, clipping and state; a hard
threshold that selects nothing on one rank or on all of them; Signum's majority vote on a case
computed by hand; and DGC reaching the optimum of the heterogeneous least-squares problem of
tests/test_convergence.py without error feedback, since it carries its own memory."""

from __future__ import annotations

import io
import math

import pytest
import torch
from test_convergence import DIM, WORKERS, loss, make_problem
from test_engine import Net, data, run_step

from gradzip.comm import cost
from gradzip.comm.sim import SimWorld
from gradzip.compress import create
from gradzip.engine import attach
from gradzip.engine.exchange import Exchange


def rand(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def exchange(comps, inputs: list[torch.Tensor], key: str = "b", world: SimWorld | None = None):
    """One exchange of one tensor per worker over a SimWorld; every worker's result."""
    world = world or SimWorld(len(comps))
    exs = [Exchange(c, world[w], [x.clone()], key) for w, (c, x) in enumerate(zip(comps, inputs))]
    for e in exs:
        e.start()
    while not all([e.advance() for e in exs]):
        pass
    return [e.result()[0] for e in exs]


# ----------------------------------------------------------------------------- dgc
def test_dgc_warmup_density_decreases_exponentially_per_key():
    c = create("dgc:ratio=0.001,warmup_steps=4,warmup_ratio=0.25")
    d = [c.density(s) for s in range(7)]
    assert d[0] == 0.25 and d[4:] == [0.001] * 3
    steps = [d[i + 1] / d[i] for i in range(4)]  # one constant factor per step: (0.001 / 0.25) ** (1 / 4)
    assert all(f == pytest.approx(0.004 ** 0.25) for f in steps)
    assert not c.fixed_size and create("dgc").fixed_size  # sizes change only during warm-up
    n = 10_000
    sent = [c.compress(rand(n, s), "a")[0][1].numel() for s in range(6)]
    assert sent == [math.ceil(x * n - 1e-9) for x in d[:6]] and sent[-1] == 10 == c.payload_bytes(n) // 8
    assert c.compress(rand(n), "other")[0][1].numel() == 2500  # counted per key: a new key starts warm-up
    assert create("dgc:ratio=0.3,warmup_steps=4").density(0) == 0.3  # warm-up never sends less than ratio


def test_dgc_warmup_payloads_change_size_through_the_exchange():
    comps = [create("dgc:ratio=0.01,warmup_steps=3") for _ in range(2)]
    world = SimWorld(2)
    for step in range(5):
        before = world.comms[0].stats.bytes_sent
        out = exchange(comps, [rand(1000, 10 * step + w) for w in range(2)], world=world)
        assert torch.equal(out[0], out[1])
        k = math.ceil(comps[0].density(step) * 1000 - 1e-9)
        assert world.comms[0].stats.bytes_sent - before == 8 * k  # two ranks: one payload each way


def test_dgc_momentum_correction_and_factor_masking():
    c = create("dgc:ratio=0.1,momentum=0.5")
    g1, g2 = rand(100, 1), rand(100, 2)
    (values, idx), _ = c.compress(g1, "k")
    top = g1.abs().topk(10).indices.sort().values
    assert torch.equal(idx.long(), top) and torch.equal(values, g1[top])
    u, v, steps = c.state["k"]
    rest = torch.ones(100, dtype=torch.bool)
    rest[top] = False
    assert (u[top] == 0).all() and (v[top] == 0).all() and steps == 1  # masked where sent
    assert torch.equal(u[rest], g1[rest]) and torch.equal(v[rest], g1[rest])  # u = g, v = u elsewhere
    u_want = 0.5 * u + g2  # momentum correction: u = m u + g, v = v + u
    v_want = v + u_want
    (values, idx), _ = c.compress(g2, "k")
    sel = v_want.abs().topk(10).indices.sort().values
    assert torch.equal(idx.long(), sel) and torch.allclose(values, v_want[sel])
    u_want[sel], v_want[sel] = 0.0, 0.0
    torch.testing.assert_close(c.state["k"][0], u_want)
    torch.testing.assert_close(c.state["k"][1], v_want)


def test_dgc_clips_the_bucket_norm_before_the_momentum():
    c = create("dgc:ratio=1.0,momentum=0,clip=1.0")  # everything sent: the output is the clipped g
    big, small = rand(50, 3), rand(30, 4)
    big, small = 5 * big / big.norm(), 0.5 * small / small.norm()
    (values, _), _ = c.compress(big, "a")
    torch.testing.assert_close(values, big / 5)
    assert torch.equal(c.compress(small, "b")[0][0], small)  # below the threshold: unchanged
    payload, ctx = c.compress_batch([big[:20], big[20:]], "bucket")  # the norm is the bucket's
    torch.testing.assert_close(torch.cat(c.decompress_batch(payload, ctx)), big / 5)
    nan = big.clone()
    nan[0] = float("nan")
    c.compress(nan, "n")
    assert torch.isfinite(c.compress(big, "n")[0][0]).all()
    assert all(torch.isfinite(t).all() for t in c.state["n"][:2])


def test_dgc_state_round_trip_undo_and_snapshot():
    spec = "dgc:ratio=0.05,warmup_steps=5"
    c = create(spec)
    for s in range(3):
        c.compress(rand(200, s), "k")
    snap = c.state_dict()
    buf = io.BytesIO()
    torch.save(snap, buf)
    buf.seek(0)
    twin = create(spec)
    twin.load_state_dict(torch.load(buf, weights_only=True))
    kept = {k: [t.clone() if isinstance(t, torch.Tensor) else t for t in v] for k, v in snap["u_v_steps"].items()}
    c.begin_step()
    c.compress(rand(200, 99), "k")
    c.end_step(keep=False)  # a skipped step: the state is back, bit for bit
    for a, b in zip(c.state["k"], kept["k"]):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    for s in range(3, 6):  # the restored copy continues identically, warm-up counter included
        x = rand(200, s)
        (va, ia), _ = c.compress(x, "k")
        (vb, ib), _ = twin.compress(x, "k")
        assert torch.equal(va, vb) and torch.equal(ia, ib)
    assert all(torch.equal(a, b) for a, b in zip(snap["u_v_steps"]["k"][:2], kept["k"][:2]))  # a snapshot
    c.set_residuals("moved", [torch.ones(2, 3), torch.ones(4)])
    assert torch.equal(c.residuals("moved")[0], torch.ones(10))
    c.forget("moved")
    assert c.residuals("moved") is None and set(c.state) == {"k"}


# ----------------------------------------------------------------------------- threshold
def test_threshold_with_nothing_selected_on_one_rank_or_on_all():
    tau = 0.5
    g = [torch.tensor([0.9, -0.1, 0.0, -2.0, 0.5, 0.3]), torch.full((6,), 0.1),
         torch.tensor([0.0, 0.6, 0.0, 0.0, 0.0, -0.49])]
    kept = [torch.where(x.abs() >= tau, x, torch.zeros(())) for x in g]
    world = SimWorld(3)
    outs = exchange([create(f"threshold:tau={tau}") for _ in range(3)], g, world=world)
    for out in outs:
        assert torch.equal(out, sum(kept) / 3)
    sizes = [8 * int((x.abs() >= tau).sum()) for x in g]  # rank 1 sends two empty tensors
    assert sizes == [24, 0, 8]
    for r in range(3):
        assert world.comms[r].stats.bytes_sent == cost.allgather_bytes(sizes, r)[0]  # counted as really sent
    outs = exchange([create("threshold:tau=10") for _ in range(3)], g)  # nobody sends anything
    assert all(torch.equal(o, torch.zeros(6)) for o in outs)


def test_threshold_through_the_engine_when_nothing_passes():
    torch.manual_seed(0)
    model = Net()
    engine = attach(model, "threshold:tau=1e9", SimWorld(2), bucket_cap_mb=0.002, min_compress_numel=32)
    st = run_step(engine, model, data(2))
    compressed = {n for b in engine.buckets if b.compressed for n in b.names}
    assert compressed and st.bytes_sent == sum(b.nbytes for b in engine.buckets if not b.compressed)
    for name, p in model.named_parameters():
        assert torch.isfinite(p.grad).all() and ((p.grad == 0).all() or name not in compressed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_threshold_selects_and_caps(dtype):
    x = rand(1000, 5).to(dtype)
    x[7] = float("nan")
    (values, idx), _ = create("threshold:tau=1.5").compress(x, "k")
    want = (x.float().abs() >= 1.5).nonzero().view(-1)
    assert idx.dtype == torch.int32 and torch.equal(idx.long(), want) and torch.equal(values, x[want])
    (values, idx), _ = create("threshold:tau=0.01,max_ratio=0.02").compress(x, "k")  # k_max = 20 of ~990
    assert idx.numel() == 20 and torch.equal(values.abs().float().sort().values,
                                              x.float().nan_to_num(0).abs().topk(20).values.sort().values)
    assert create("threshold:tau=0.01,max_ratio=0.02").payload_bytes(1000, dtype) == 20 * (x.element_size() + 4)


# ----------------------------------------------------------------------------- signum
def test_signum_majority_vote_of_momenta_by_hand():
    g1 = [[1.0, -2.0, 3.0, -4.0], [-1.0, 2.0, 3.0, 4.0], [2.0, 2.0, -3.0, -4.0]]
    g2 = [[-4.0, 0.0, 0.0, 0.0], [0.0, 0.0, -8.0, 0.0], [2.0, 0.0, 0.0, 4.0]]
    comps = [create("signum:momentum=0.5") for _ in range(3)]
    world = SimWorld(3)
    # Step 1: m = g / 2, signs (+,-,+,-), (-,+,+,+), (+,+,-,-); scales 1.25, 1.25, 1.375.
    out = exchange(comps, [torch.tensor(g) for g in g1], world=world)[0]
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, 1.0, -1.0]) * (3.875 / 3))
    # Step 2: m = m / 2 + g / 2 = (-1.75, -0.5, 0.75, -1), (-0.25, 0.5, -3.25, 1), (1.5, 0.5, -0.75, 1):
    # votes (-1, +1, -1, +1); scales 1.0, 1.25, 0.9375, mean 1.0625 (signSGD on g2 alone would differ).
    out = exchange(comps, [torch.tensor(g) for g in g2], world=world)
    assert all(torch.equal(o, torch.tensor([-1.0625, 1.0625, -1.0625, 1.0625])) for o in out)
    torch.testing.assert_close(comps[1].state["b"], torch.tensor([-0.25, 0.5, -3.25, 1.0]))
    pair = [create("signum:momentum=0.5") for _ in range(2)]
    tie = exchange(pair, [torch.tensor([1.0, 2.0]), torch.tensor([-1.0, 2.0])])
    assert torch.equal(tie[0], torch.tensor([0.0, 0.75]))  # a tie gives 0; mean scale (0.75 + 0.75) / 2


def test_signum_momentum_survives_a_non_finite_step_and_undo():
    c = create("signum")
    c.compress(torch.ones(5), "k")
    c.begin_step()
    c.compress(torch.tensor([float("nan"), float("inf"), 1.0, 1.0, 1.0]), "k")
    assert torch.isfinite(c.state["k"]).all()
    c.end_step(keep=False)
    assert torch.equal(c.state["k"], torch.full((5,), 0.1))


# ----------------------------------------------------------------------------- convergence
def _subopt(spec: str, steps: int, lr: float) -> float:
    """Suboptimality of the mean of the last half of the GD iterates (see tests/test_convergence.py),
    the workers' gradients averaged by the compressed exchange."""
    A, b = make_problem()
    x_star = torch.linalg.lstsq(torch.cat(A), torch.cat(b)).solution
    world, comps = SimWorld(WORKERS), [create(spec) for _ in range(WORKERS)]
    x = torch.zeros(DIM, dtype=torch.float64)
    avg = torch.zeros_like(x)
    for step in range(steps):
        grads = [(a.T @ (a @ x - y) / a.shape[0]).float() for a, y in zip(A, b)]
        x = x - lr * exchange(comps, grads, "x", world)[0].double()
        if step >= steps // 2:
            avg += x / (steps - steps // 2)
    f_star = loss(A, b, x_star)
    return (loss(A, b, avg) - f_star) / (loss(A, b, torch.zeros(DIM, dtype=torch.float64)) - f_star)


@pytest.mark.timeout(120)
def test_dgc_converges_without_error_feedback():
    """Measured: dgc ~2e-3 (momentum 0.9 inside, lr 0.005: the step of lr 0.05 without momentum);
    top-k without memory stalls at ~0.58."""
    assert _subopt("dgc:ratio=0.01", 600, 0.005) < 1e-2
    assert _subopt("dgc:ratio=0.01,warmup_steps=100", 600, 0.005) < 1e-2
    assert _subopt("topk:ratio=0.01,ef=false", 600, 0.05) > 0.3
