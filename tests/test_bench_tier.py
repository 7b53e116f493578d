"""Levers of the bench tier's recipe probes: the initialisation scale (--init-std), the WordNet
downstream task in a sweep's [downstream] table."""

from __future__ import annotations

import pytest
import torch

from gradzip.errors import GradzipError
from gradzip.experiments.downstream import parse_downstream
from gradzip.training.config import TrainConfig


def test_init_std_scales_the_initial_weights(tmp_path) -> None:
    """--init-std sets the standard deviation of the initial weights (BERT's initializer_range)."""
    from gradzip.training.loop import train

    out = tmp_path / "run"
    train(TrainConfig(corpus="hmm:states=4,words=60", model="bert-tiny", backend="sim", workers=1, seq_len=16,
                      batch_size=2, steps=1, eval_every=0, eval_batches=0, checkpoint_every=1, lr=1e-9, warmup=0,
                      progress=False, init_std=0.08, out=str(out)))
    (ckpt,) = out.glob("ckpt-*.pt")
    weights = torch.load(ckpt, weights_only=True)["shared"]["model"]
    assert float(weights["bert.encoder.layer.0.attention.self.query.weight"].std()) == pytest.approx(0.08, rel=0.05)
    assert 'init_std = 0.08' in (out / "config.toml").read_text()


def test_init_std_must_be_positive() -> None:
    with pytest.raises(GradzipError, match="--init-std must be a positive number"):
        TrainConfig(init_std=0.0).validate()
    assert torch.isfinite(torch.tensor(TrainConfig().init_std))


def test_downstream_task_wordnet_parses(tmp_path) -> None:
    ds = parse_downstream({"task": "wordnet", "seeds": 3, "examples": [2000, 1000]}, tmp_path / "s.toml")
    assert ds.task == "wordnet" and ds.examples == (2000, 1000)
    from gradzip.errors import SpecError

    with pytest.raises(SpecError, match="keywords.*wordnet"):
        parse_downstream({"task": "glue"}, tmp_path / "s.toml")


def test_one_worker_says_nothing_is_compressed(tmp_path, capsys) -> None:
    from gradzip.cli import main

    assert main(["train", "--corpus", "hmm:states=4,words=60", "--workers", "1", "--steps", "1", "--seq-len", "16",
                 "--batch-size", "2", "--eval-every", "0", "--checkpoint-every", "0", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "nothing to compress with one worker" in out and "n/a" not in out
