"""Levers of the bench tier's recipe probes: the initialisation scale (--init-std), pre-LN blocks
(--pre-ln), whole-word masking (--whole-word-masking), the WordNet downstream task in a sweep's
[downstream] table."""

from __future__ import annotations

import json

import pytest
import torch

from gradzip.errors import GradzipError
from gradzip.experiments.downstream import parse_downstream
from gradzip.training.config import TrainConfig, load_toml, write_toml


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


def test_pre_ln_trains_and_its_loss_falls(tmp_path) -> None:
    """A 30-step sim run with --pre-ln: the checkpoint holds the pre-LN weights, the loss falls."""
    from gradzip.cli import main

    out = tmp_path / "run"
    assert main(["train", "--corpus", "hmm:states=4,words=60", "--pre-ln", "--workers", "2", "--seq-len", "16",
                 "--batch-size", "8", "--steps", "30", "--lr", "3e-3", "--warmup", "3", "--dropout", "0",
                 "--eval-every", "0", "--eval-batches", "2", "--checkpoint-every", "30", "--no-progress",
                 "--out", str(out)]) == 0
    assert "pre_ln = true" in (out / "config.toml").read_text()
    (ckpt,) = out.glob("ckpt-*.pt")
    weights = torch.load(ckpt, weights_only=True)["shared"]["model"]
    assert "bert.LayerNorm.weight" in weights and "bert.encoder.layer.1.intermediate.LayerNorm.bias" in weights
    assert "bert.encoder.layer.0.output.LayerNorm.weight" not in weights
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line and '"step"' in line]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3


def test_levers_are_part_of_the_run_configuration(tmp_path) -> None:
    """--pre-ln and --whole-word-masking: config.toml round trip, the ranks' agreement, off by default."""
    assert (TrainConfig().pre_ln, TrainConfig().whole_word_masking) == (False, False)
    cfg = TrainConfig.from_dict({"pre-ln": True, "whole_word_masking": True})
    write_toml(cfg, tmp_path / "config.toml")
    text = (tmp_path / "config.toml").read_text()
    assert "pre_ln = true" in text and "whole_word_masking = true" in text
    assert TrainConfig.from_dict(load_toml(tmp_path / "config.toml")) == cfg
    assert cfg.agreement()["pre_ln"] is True and cfg.agreement()["whole_word_masking"] is True
    assert cfg.diff(TrainConfig()) == ["--pre-ln True vs False", "--whole-word-masking True vs False"]
    with pytest.raises(GradzipError, match="pre_ln must be true or false"):
        TrainConfig.from_dict({"pre_ln": "yes"})


def test_whole_word_masking_on_a_generated_language_is_one_line(tmp_path, capsys) -> None:
    from gradzip.cli import main

    with pytest.raises(GradzipError, match="--whole-word-masking: a generated language"):
        TrainConfig.from_dict({"corpus": "hmm", "whole_word_masking": True})
    assert main(["train", "--corpus", "hmm", "--whole-word-masking", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "drop --whole-word-masking" in err
    assert not (tmp_path / "o").exists()


def test_whole_word_masking_trains_on_real_text(tmp_path, corpus) -> None:
    from gradzip.cli import main

    out = tmp_path / "run"
    assert main(["train", "--corpus", str(corpus), "--whole-word-masking", "--workers", "1", "--seq-len", "32",
                 "--batch-size", "4", "--steps", "2", "--eval-batches", "1", "--checkpoint-every", "0",
                 "--no-progress", "--out", str(out)]) == 0
    assert "whole_word_masking = true" in (out / "config.toml").read_text()


def test_a_pre_ln_run_fine_tunes_and_saves_a_roberta_prelayernorm_classifier(tmp_path, corpus) -> None:
    """gradzip finetune reads a --pre-ln run as it trained it; the saved classifier loads as
    RobertaPreLayerNormForSequenceClassification and gives the recorded validation loss."""
    from gradzip.cli import main

    run, task, ft = tmp_path / "run", tmp_path / "task", tmp_path / "ft"
    assert main(["train", "--corpus", str(corpus), "--pre-ln", "--workers", "1", "--seq-len", "64", "--batch-size",
                 "4", "--steps", "2", "--eval-batches", "1", "--checkpoint-every", "1", "--no-progress",
                 "--out", str(run)]) == 0
    assert main(["finetune", "--make-synthetic", str(task), "--corpus", str(corpus), "--examples", "32", "32"]) == 0
    assert main(["finetune", str(run), "--train", str(task / "train.jsonl"), "--validation",
                 str(task / "validation.jsonl"), "--epochs", "1", "--batch-size", "16", "--seq-len", "48",
                 "--out", str(ft)]) == 0
    s = json.loads((ft / "summary.json").read_text())
    config = json.loads((ft / "model" / "config.json").read_text())
    assert config["architectures"] == ["RobertaPreLayerNormForSequenceClassification"]
    assert "RobertaPreLayerNormForSequenceClassification.from_pretrained" in (ft / "model" / "README.md").read_text()
    transformers = pytest.importorskip("transformers")
    model = transformers.RobertaPreLayerNormForSequenceClassification.from_pretrained(ft / "model").eval()
    tok = transformers.BertTokenizerFast.from_pretrained(ft / "model")
    rows = [json.loads(x) for x in (task / "validation.jsonl").read_text().splitlines()]
    enc = tok([r["text"] for r in rows], padding=True, truncation=True, max_length=48, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    labels = torch.tensor([r["label"] for r in rows])
    assert float(torch.nn.functional.cross_entropy(logits, labels)) == pytest.approx(s["eval_loss"], abs=1e-5)
