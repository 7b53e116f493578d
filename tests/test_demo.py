"""DeMo (:mod:`gradzip.compress.demo`, :mod:`gradzip.optim.demo`): the chunked DCT against
scipy and its round trip, the per-chunk top-k, the payload formula against the bytes the engine
counts, the momentum's error feedback, ``ef=`` ignored, the standalone optimizer against the
engine path (threaded SimWorld ranks; Gloo/MPI processes are in tests/test_engine_dist.py),
``gradzip train --optimizer demo`` on 1 and 4 workers, and its bit-identical resume. The
compressor also runs through every generic test of tests/test_compressors.py."""

from __future__ import annotations

import copy
import io
import json
import math
import sys

import pytest
import torch
from scipy.fft import dctn
from test_engine import Net, data, loss_of, run_ranks
from test_train import TINY, computed, losses, train_cli

from gradzip.comm.sim import SimWorld
from gradzip.compress import create, dct
from gradzip.compress.demo import DeMoCompressor
from gradzip.engine import attach
from gradzip.optim import DeMo
from gradzip.training import checkpoint
from gradzip.training.metrics import read_metrics

SHAPES = [(), (1,), (7,), (13, 5), (3, 4, 5), (1000,), (64, 33), (64, 64), (130, 70), (200, 130)]


def rand(shape, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def chunks(pl: dct.Plan):
    """(rows slice, cols slice, block-major slice) of every chunk, in block-major order."""
    for g in pl.regions:
        for i in range(g.p):
            for j in range(g.q):
                start = g.off + (i * g.q + j) * g.a * g.b
                yield (slice(g.r0 + i * g.a, g.r0 + (i + 1) * g.a), slice(g.c0 + j * g.b, g.c0 + (j + 1) * g.b),
                       slice(start, start + g.a * g.b), g)


# ----------------------------------------------------------------------------- the transform
def test_basis_is_orthonormal_and_every_chunk_is_scipys_dct_ii():
    for n in (1, 2, 7, 64):
        d = dct.basis(n)
        torch.testing.assert_close(d @ d.T, torch.eye(n), rtol=0, atol=1e-6)
    for shape, chunk in [((130, 70), 64), ((200, 130), 64), ((1000,), 64), ((13, 5), 4), ((3, 4, 5), 3)]:
        pl = dct.plan(shape, chunk, 1)
        x = rand(shape).reshape(pl.rows, pl.cols)
        coeffs = dct.forward(x, pl)
        seen = 0
        for rows, cols, where, g in chunks(pl):
            want = torch.from_numpy(dctn(x[rows, cols].double().numpy(), type=2, norm="ortho")).float()
            torch.testing.assert_close(coeffs[where].view(g.a, g.b), want, rtol=0, atol=2e-5)
            seen += g.a * g.b
        assert seen == math.prod(shape), "the chunks tile the tensor exactly"


@pytest.mark.parametrize("chunk", [8, 64])
def test_round_trip_with_every_coefficient_is_the_identity(chunk):
    """topk >= chunk²: every coefficient is sent, the decoded mean of one rank is its input, and δ
    keeps only fp32 rounding."""
    c = create(f"demo:topk={chunk * chunk},chunk={chunk},decay=0.9")
    for i, shape in enumerate(SHAPES):
        x = rand(shape, seed=i)
        pl = dct.plan(tuple(shape), chunk, chunk * chunk)
        torch.testing.assert_close(dct.inverse(dct.forward(x.reshape(pl.rows, pl.cols), pl), pl).view(shape), x,
                                   rtol=0, atol=2e-6)
        payload, ctx = c.compress_batch([x], f"k{i}")
        out = c.aggregate(c.decompress_batch(payload, ctx))
        assert out.shape == x.shape and out.dtype == x.dtype
        torch.testing.assert_close(out, x, rtol=0, atol=2e-6)
        assert float(c.state[f"k{i}/0"].abs().max()) < 2e-6
        assert pl.kept == max(1, math.prod(shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_top_k_keeps_the_largest_coefficients_of_every_chunk(dtype):
    c = create("demo:topk=5,chunk=64")
    x = rand((130, 70), seed=3)
    pl = dct.plan((130, 70), 64, 5)
    coeffs = dct.forward(x, pl)
    payload, ctx = c.compress_batch([x.to(dtype)], "b")
    sent = c.decompress_batch(payload, ctx)[0].reshape(-1).float()  # this rank's coefficients, block-major
    if dtype == torch.float32:
        assert (sent != 0).sum() == pl.kept == 6 * 5  # chunks 64² and 64×6 (x2 each), 2×64, 2×6: 5 each
    for _, _, where, g in chunks(pl):
        kept = sent[where].nonzero().view(-1)
        assert kept.numel() == min(5, g.a * g.b)
        want = coeffs[where].abs().topk(kept.numel()).values
        assert torch.equal(coeffs[where][kept].abs().sort(descending=True).values, want)  # exactly the top 5
        if dtype == torch.float32:  # bf16 inputs differ in the last bits: compare the fp32 path exactly
            assert torch.equal(sent[where][kept], coeffs[where][kept])


# ----------------------------------------------------------------------------- bytes
def test_payload_bytes_formula_and_what_the_engine_counts():
    c = create("demo")  # topk 32, chunk 64: 12-bit indices for 64 x 64 chunks
    assert c.payload_bytes((64, 64)) == 32 * 12 // 8 + 32 * 4 == 176
    # 200 x 130: chunks 64²(x6), 64×2 (x3), 8×64 (x2), 8×2 (x1): K = 6·32 + 3·32 + 2·32 + 16 = 368
    assert c.payload_bytes((200, 130)) == 368 * 12 // 8 + 368 * 4 == 2024
    assert c.payload_bytes((200, 130), torch.bfloat16) == 552 + 368 * 2
    assert c.payload_bytes(1000) == c.payload_bytes((1000,)) == 512 * 6 // 8 + 512 * 4  # 1 × 64 chunks: 6 bits
    assert c.payload_bytes(()) == 1 + 4 and c.payload_bytes((0,)) == 0 and c.payload_bytes((5, 0)) == 0
    assert create("demo:topk=3,chunk=8").payload_bytes((13, 5)) == math.ceil(2 * 3 * 6 / 8) + 6 * 4  # 8×5, 5×5
    # What the communicator counts: a ring allgather of equal payloads sends (n−1)·payload per rank.
    torch.manual_seed(0)
    model = Net()
    engine = attach(model, "demo:topk=4,chunk=8", SimWorld(4), bucket_cap_mb=0.002, min_compress_numel=0)
    opt = DeMo(model.parameters(), lr=0.01)
    opt.configure(engine)
    for w in engine.worker_ids:
        with engine.worker(w):
            loss_of(model, data(4)[w]).backward()
    st = engine.finalize()
    payload = sum(engine.compressor.batch_payload_bytes(b.shapes, b.dtype) for b in engine.buckets)
    assert all(b.compressed for b in engine.buckets) and len(engine.buckets) > 1
    assert st.bytes_sent == st.bytes_recv == 3 * payload


# ----------------------------------------------------------------------------- momentum, error feedback
def test_delta_is_decayed_delta_plus_g_minus_what_was_sent():
    c = create("demo:topk=3,chunk=8,decay=0.9")
    shapes = [(20, 13), (30,), (2, 3, 4)]
    before = [torch.zeros(math.prod(s)) for s in shapes]
    for step in range(4):
        g = [rand(s, seed=10 * step + i) for i, s in enumerate(shapes)]
        payload, ctx = c.compress_batch(g, "b")
        sent = [c.aggregate([part]) for part in c.decompress_batch(tuple(p.clone() for p in payload), ctx)]
        after = [c.state[f"b/{i}"] for i in range(len(shapes))]
        for b, gi, s, a in zip(before, g, sent, after):
            torch.testing.assert_close(a, 0.9 * b + gi.reshape(-1) - s.reshape(-1), rtol=0, atol=1e-5)
        assert float(after[0].abs().sum()) > 0  # 3 of 64 coefficients per chunk: most stays in δ
        before = [a.clone() for a in after]
    c.begin_step()  # an undone step leaves δ as it was
    c.compress_batch([torch.full(s, float("nan")) for s in shapes], "b")
    c.end_step(keep=False)
    assert all(torch.equal(c.state[f"b/{i}"], before[i]) for i in range(len(shapes)))


def test_ef_is_ignored_with_a_warning_and_bad_values_name_the_field(monkeypatch):
    monkeypatch.setattr(sys.modules["gradzip.compress.registry"], "_WARNED", set())  # warned once per process
    for ef in ("true", "ef21"):
        with pytest.warns(UserWarning, match=f"demo: ef={ef} is ignored: demo keeps its own error feedback"):
            c = create(f"demo:topk=8,ef={ef}")
        assert type(c) is DeMoCompressor and c.spec == "demo:topk=8,chunk=64,decay=0.999"
    for bad, msg in [("topk=0", "topk must be >= 1"), ("chunk=257", "chunk must be in [1, 256]"),
                     ("decay=1.5", "decay must be in [0, 1]"), ("chunk=x", "chunk='x' is not a valid int")]:
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            create(f"demo:{bad}")
    with pytest.raises(ValueError, match="need lr >= 0"):
        DeMo([torch.nn.Parameter(torch.zeros(2))], lr=-1.0)
    with pytest.raises(ValueError, match="chunk must be in"):
        DeMo([torch.nn.Parameter(torch.zeros(2))], lr=1.0, compression_chunk=0)


# ----------------------------------------------------------------------------- the optimizer
def _engine_path(base: Net, n: int, steps: int, spec: str, lr: float, wd: float) -> Net:
    model = copy.deepcopy(base)
    engine = attach(model, spec, SimWorld(n), bucket_cap_mb=0.002, min_compress_numel=0)
    opt = DeMo(model.parameters(), lr=lr, weight_decay=wd)
    for step in range(steps):
        opt.configure(engine)
        for w in engine.worker_ids:
            with engine.worker(w):
                loss_of(model, data(n, step)[w]).backward()
        engine.finalize()
        opt.step()
    return model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_standalone_optimizer_equals_the_engine_path_and_resumes(n):
    """Ranks as threads of a threaded SimWorld, each with its own DeMo(comm=...): the same
    parameters as the engine with the demo compressor and DeMo.configure, bit for bit; a state_dict
    saved after 2 steps (weights_only) continues identically."""
    torch.manual_seed(1)
    base = Net()
    kw = dict(compression_topk=4, compression_chunk=8, compression_decay=0.9, weight_decay=0.1)
    lr, steps = 0.01, 3
    ref = _engine_path(base, n, steps, "demo:topk=4,chunk=8,decay=0.9", lr, kw["weight_decay"])
    world, world2 = SimWorld(n, threaded=True, timeout=30), SimWorld(n, threaded=True, timeout=30)
    out: dict[int, tuple] = {}

    def rank_main(r: int) -> None:
        model = copy.deepcopy(base)
        opt = DeMo(model.parameters(), lr=lr, comm=world[r], **kw)
        saved = None
        for step in range(steps):
            model.zero_grad(set_to_none=True)
            loss_of(model, data(n, step)[r]).backward()
            opt.step()
            if step == 1:
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
                saved = buf.getvalue()
        # Resume from step 2 with fresh objects on a fresh world.
        sd = torch.load(io.BytesIO(saved), weights_only=True)
        again = copy.deepcopy(base)
        again.load_state_dict(sd["model"])
        opt2 = DeMo(again.parameters(), lr=lr, comm=world2[r], **kw)
        opt2.load_state_dict(sd["opt"])
        again.zero_grad(set_to_none=True)
        loss_of(again, data(n, 2)[r]).backward()
        opt2.step()
        out[r] = (model, again, sd["opt"]["demo"])

    run_ranks(rank_main, n, timeout=100)
    want = [p for p in ref.parameters()]
    for r in range(n):
        model, again, state = out[r]
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), want)), f"rank {r} differs from the engine"
        assert all(torch.equal(a, b) for a, b in zip(again.parameters(), want)), f"rank {r}: resume differs"
        assert len(state["delta"]) == sum(1 for p in base.parameters() if p.numel())
    assert not all(torch.equal(a, b) for a, b in zip(want, base.parameters()))


def test_train_mode_steps_the_sign_with_decoupled_weight_decay():
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    opt = DeMo([w], lr=0.1, weight_decay=0.5)
    assert opt.frozen
    w.grad = torch.tensor([0.3, -1e-9, 0.0, -4.0])  # what the engine decoded
    opt.step()
    assert w.tolist() == pytest.approx([v * (1 - 0.05) - 0.1 * s for v, s in zip([1, -2, 3, 0.5], [1, -1, 0, -1])])


# ----------------------------------------------------------------------------- gradzip train
@pytest.fixture
def tiny(corpus) -> list[str]:
    return [*TINY, "--corpus", str(corpus), "--optimizer", "demo"]


@pytest.mark.parametrize("workers", [1, 4])
def test_gradzip_train_demo_learns(tmp_path, tiny, workers):
    out = tmp_path / "run"
    assert train_cli(*tiny, "--workers", str(workers), "--steps", "10", "--out", str(out)) == 0
    loss = losses(out)
    assert len(loss) == 10 and all(math.isfinite(v) for v in loss)
    assert sum(loss[-3:]) / 3 < loss[0] - 0.4, loss
    sent = {r["bytes_sent"] for r in read_metrics(out / "metrics.jsonl")}
    assert len(sent) == 1 and (sent.pop() > 0) == (workers > 1)  # fixed-size payloads; alone: nothing to send
    summary = json.loads((out / "summary.json").read_text())
    assert summary["spec"] == "demo:topk=32,chunk=64,decay=0.999" and summary["optimizer"] == "demo"
    if workers > 1:
        assert summary["compression_ratio"] > 10


def test_gradzip_train_demo_resumes_bit_for_bit(tmp_path, tiny):
    full, part = tmp_path / "full", tmp_path / "part"
    args = [*tiny, "--compressor", "demo:topk=16,chunk=32", "--steps", "6"]
    assert train_cli(*args, "--out", str(full)) == 0
    assert train_cli(*args, "--stop-at", "3", "--out", str(part)) == 0
    assert [s for s, _ in checkpoint.list_checkpoints(part)] == [3]
    assert train_cli("--out", str(part), "--resume") == 0
    assert computed(part) == computed(full) and len(losses(full)) == 6
