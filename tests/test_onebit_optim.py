"""1-bit Adam and 1-bit LAMB (:mod:`gradzip.optim.onebit`): the engine delivers the
average of the workers' local momenta once warm-up is over, the variance stays frozen, warm-up is
Adam, the bytes drop to the compressed momentum's at the freeze, and ``gradzip train`` resumes
bit for bit on either side of the freeze."""

from __future__ import annotations

import pytest
import torch
from test_engine import Net, data, loss_of, manual_mean_grads
from test_train import TINY, computed, train_cli

from gradzip.comm.sim import SimWorld
from gradzip.engine import attach
from gradzip.optim.build import param_groups
from gradzip.optim.lamb import ADAM_BETAS, ADAM_EPS
from gradzip.optim.onebit import OneBitAdam
from gradzip.training.metrics import read_metrics


@pytest.fixture
def tiny(corpus) -> list[str]:
    return [*TINY, "--corpus", str(corpus)]


def _step(engine, model, opt, step: int) -> None:
    opt.configure(engine)
    n = engine.num_workers
    for w in engine.worker_ids:
        with engine.worker(w):
            loss_of(model, data(n, step)[w]).backward()
    engine.finalize()
    opt.step()


@pytest.mark.parametrize("lamb", [False, True], ids=["adam", "lamb"])
def test_the_engine_delivers_the_mean_local_momentum_and_the_variance_stays_frozen(lamb):
    """With an exact exchange (``none``), the compression stage's momentum is β1·m + (1−β1)·(mean
    gradient), the same as Adam's, and v does not move; in warm-up the engine sends plain gradients."""
    torch.manual_seed(0)
    model = Net()
    engine = attach(model, "none", SimWorld(3), min_compress_numel=32)
    opt = OneBitAdam(param_groups(model, 0.01), lr=1e-3, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.01,
                     freeze_step=2, lamb=lamb)
    params = [p for p in model.parameters() if p.numel()]
    for step in range(2):
        _step(engine, model, opt, step)
        assert engine.transform is None  # configure() of this step: warm-up
    assert opt.frozen
    beta1 = ADAM_BETAS[0]
    for step in (2, 3):
        m_prev = [opt.state[p]["exp_avg"].clone() for p in params]
        v_prev = [opt.state[p]["exp_avg_sq"].clone() for p in params]
        mean_g = [g for g, p in zip(manual_mean_grads(model, data(3, step)), model.parameters()) if p.numel()]
        _step(engine, model, opt, step)
        assert engine.compressing and engine.transform is not None
        for p, m0, v0, g in zip(params, m_prev, v_prev, mean_g):
            torch.testing.assert_close(opt.state[p]["exp_avg"], beta1 * m0 + (1 - beta1) * g, rtol=1e-5, atol=1e-7)
            assert torch.equal(opt.state[p]["exp_avg_sq"], v0)
            assert torch.isfinite(p).all()


def test_freeze_step_must_be_positive():
    with pytest.raises(ValueError, match="freeze_step must be >= 1"):
        OneBitAdam(param_groups(Net(), 0.0), lr=1e-3, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0, freeze_step=0)


@pytest.mark.parametrize("optimizer, baseline", [("onebit-adam", "adamw"), ("onebit-lamb", "lamb")])
def test_gradzip_train_warm_up_bytes_and_resume_across_the_freeze(tmp_path, tiny, optimizer, baseline):
    args = [*tiny, "--steps", "6", "--freeze-step", "3"]
    full, base = tmp_path / "full", tmp_path / "base"
    assert train_cli(*args, "--optimizer", optimizer, "--out", str(full)) == 0
    assert train_cli(*args, "--optimizer", baseline, "--out", str(base)) == 0
    one, ref = read_metrics(full / "metrics.jsonl"), read_metrics(base / "metrics.jsonl")
    # Warm-up is the baseline optimizer on uncompressed gradients (the same math, our own code).
    for a, b in zip(one[:4], ref[:4]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert [r["bytes_sent"] for r in one[:3]] == [r["bytes_sent"] for r in ref[:3]]
    compressed = {r["bytes_sent"] for r in one[3:]}
    assert len(compressed) == 1 and compressed.pop() * 10 < ref[0]["bytes_sent"]  # 1-bit momentum from step 4
    for stop in (2, 5):  # a checkpoint before the freeze, and one after it
        part = tmp_path / f"part{stop}"
        assert train_cli(*args, "--optimizer", optimizer, "--stop-at", str(stop), "--out", str(part)) == 0
        assert train_cli("--out", str(part), "--resume") == 0
        # (--stop-at also evaluates at its step: drop that one eval_loss, the last field)
        got = [r[:-1] + ((None,) if r[0] == stop and stop % 3 else r[-1:]) for r in computed(part)]
        assert got == computed(full)
