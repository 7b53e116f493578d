"""`gradzip export RUN_DIR --to hf OUT_DIR [--step N]`: the exported directory loads into
``transformers`` unchanged and computes gradzip's logits (1e-5, as tests/test_hf_parity.py), its
tokenizer gives gradzip's ids, its model card holds the run's numbers, and bad input is one line,
exit code 2, with nothing written or overwritten. One tiny run is trained for the whole module."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from gradzip.cli import main
from gradzip.data import PretrainData
from gradzip.models import BertForPreTraining, bert_config, load_hf_state_dict
from gradzip.training import checkpoint, export

SPEC = "topk:ratio=0.05,ef=true"
SEQ_LEN = 64


def tree(d: Path) -> dict[str, bytes | None]:
    """Every path under ``d`` (relative) with its bytes (None for a directory)."""
    return {p.relative_to(d).as_posix(): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "run"
    assert main(["train", "--model", "bert-tiny", "--seq-len", str(SEQ_LEN), "--batch-size", "4", "--workers", "2",
                 "--steps", "2", "--checkpoint-every", "1", "--eval-batches", "2", "--no-progress",
                 "--compressor", SPEC, "--corpus", str(corpus), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def exported(run) -> Path:
    pytest.importorskip("safetensors", reason="the export needs `pip install gradzip[hf]`")
    out = run.parent / "hf"
    assert export.export_hf(run, out) == out
    return out


@pytest.fixture(scope="module")
def data(corpus) -> PretrainData:
    # The run's data, as the training runtime builds it (bert-tiny's default vocabulary, seed 0).
    return PretrainData.build(corpus=corpus, seq_len=SEQ_LEN, vocab_size=bert_config("bert-tiny").vocab_size,
                              seed=0, progress=False)


def ours(run: Path, step: int, pre_ln: bool = False) -> BertForPreTraining:
    """gradzip's model with the weights of checkpoint ``step``."""
    sd = checkpoint.read(checkpoint.checkpoint_path(run, step), 0)["shared"]["model"]
    v, p = (sd[f"bert.embeddings.{n}_embeddings.weight"].shape[0] for n in ("word", "position"))
    model = BertForPreTraining(bert_config("bert-tiny", vocab_size=v, max_position_embeddings=p,
                                           pre_layer_norm=pre_ln))
    load_hf_state_dict(model, sd)
    return model.eval()


def test_writes_the_hf_files(exported):
    assert sorted(p.name for p in exported.iterdir()) == [
        "README.md", "config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json", "vocab.txt"]
    assert not list(exported.parent.glob("*.gztmp"))  # the temporary directory was renamed, not left
    cfg = json.loads((exported / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"], cfg["hidden_size"], cfg["num_hidden_layers"]) == \
        ("bert", ["BertForPreTraining"], 128, 2)


def test_logits_equal_ours(run, exported, data):
    transformers = pytest.importorskip("transformers", reason="loading the export needs `pip install gradzip[hf]`")
    pre, info = transformers.BertForPreTraining.from_pretrained(exported, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    mlm, info = transformers.BertForMaskedLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # What BertForMaskedLM has no use for (as with Google's checkpoints): the pooler and the NSP head.
    assert {k.split(".")[1] for k in info["unexpected_keys"]} <= {"pooler", "seq_relationship"}
    assert pre.cls.predictions.decoder.weight is pre.bert.embeddings.word_embeddings.weight  # tied on load
    batch = next(iter(data.eval_batches(batch_size=4, max_batches=1)))
    inputs = {k: batch[k].clone() for k in ("input_ids", "token_type_ids", "attention_mask")}
    for row, length in ((1, 40), (2, 17)):  # padded rows: the masking conventions are compared too
        inputs["attention_mask"][row, length:] = 0
        inputs["token_type_ids"][row, length:] = 0
        inputs["input_ids"][row, length:] = data.tokenizer.pad_id
    with torch.no_grad():
        ref = ours(run, 2)(**inputs, full_logits=True)
        got_pre = pre.eval()(**inputs)
        got_mlm = mlm.eval()(**inputs)
    torch.testing.assert_close(got_pre.prediction_logits, ref.prediction_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_pre.seq_relationship_logits, ref.seq_relationship_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_mlm.logits, ref.prediction_logits, rtol=0, atol=1e-5)


def test_tokenizer_round_trips(exported, data, corpus):
    transformers = pytest.importorskip("transformers", reason="loading the export needs `pip install gradzip[hf]`")
    tok = data.tokenizer
    texts = [t for t in corpus.read_text(encoding="utf-8").split("\n\n") if t.strip()][:150]
    texts += ["Héllo WÖRLD, naïve café: 東京 [MASK] tab\there", "[CLS] x [SEP] y [PAD]", ""]
    for cls in (transformers.BertTokenizerFast, transformers.AutoTokenizer):
        hf = cls.from_pretrained(exported)
        assert len(hf) == tok.vocab_size
        assert (hf.pad_token_id, hf.unk_token_id, hf.cls_token_id, hf.sep_token_id, hf.mask_token_id) == \
            (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id)
        for a, b in zip(texts, texts[1:] + texts[:1]):
            assert hf(a)["input_ids"] == tok.encode(a), a[:80]
            b = b or "the other segment"  # HF reads an empty text_pair as no pair at all
            pair = tok.tokenizer.encode(a, b)
            got = hf(a, b)
            assert (got["input_ids"], got["token_type_ids"]) == (pair.ids, pair.type_ids), a[:80]
        ids = tok.encode(texts[0])
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)


def test_model_card_holds_the_runs_numbers(run, exported):
    card = (exported / "README.md").read_text()
    s = json.loads((run / "summary.json").read_text())
    assert card.startswith("---\nlibrary_name: transformers\n")
    for text in (f"`{SPEC}`", "step 2 of 2", f"| steps | {s['steps']} |", f"| tokens | {s['tokens']:,} |",
                 f"{s['bytes_total']:,}", f"{s['final_loss']:.4f}", f"{s['final_eval_loss']:.4f}",
                 f"{s['final_eval_mlm_loss']:.4f}"):
        assert text in card, text


def test_step_selects_the_checkpoint(run, capsys):
    pytest.importorskip("safetensors", reason="the export needs `pip install gradzip[hf]`")
    out = run.parent / "hf-step1"
    out.mkdir()  # an existing empty OUT_DIR is used
    assert main(["export", str(run), "--to", "hf", str(out), "--step", "1"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    step1 = ours(run, 1).state_dict()
    assert set(weights) == set(step1) - set(export._TIED)
    assert all(torch.equal(weights[k], step1[k]) for k in weights)
    assert not torch.equal(weights["bert.pooler.dense.weight"], ours(run, 2).state_dict()["bert.pooler.dense.weight"])
    assert "step 1 of 2" in (out / "README.md").read_text()


def _fails(argv: list[str], capsys, watch: Path, match: str) -> None:
    """``gradzip export ARGV`` exits 2 with one line naming ``match``, and ``watch`` is unchanged."""
    before = tree(watch)
    capsys.readouterr()
    assert main(["export", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gradzip export: error: ") and match in err, err
    assert tree(watch) == before


def test_bad_input_is_one_line_and_writes_nothing(run, tmp_path, capsys):
    out = tmp_path / "out"
    empty = tmp_path / "empty-run"
    empty.mkdir()
    (empty / "config.toml").write_bytes((run / "config.toml").read_bytes())
    _fails([str(empty), "--to", "hf", str(out)], capsys, tmp_path, "holds no checkpoint")
    _fails([str(tmp_path / "nope"), "--to", "hf", str(out)], capsys, tmp_path, "does not exist")
    _fails([str(run), "--to", "hf", str(out), "--step", "7"], capsys, tmp_path, "step(s) 1, 2")
    _fails([str(run), "--to", "onnx", str(out)], capsys, tmp_path, "unknown format")
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _fails([str(run), "--to", "hf", str(out)], capsys, tmp_path, "exists and is not empty")
    (tmp_path / "file").write_text("a file")
    _fails([str(run), "--to", "hf", str(tmp_path / "file")], capsys, tmp_path, "is not a directory")


def test_failed_write_leaves_nothing(run, tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "_safetensors_save", lambda: broken)
    _fails([str(run), "--to", "hf", str(tmp_path / "out")], capsys, tmp_path, "No space left on device")
    (tmp_path / "empty").mkdir()
    _fails([str(run), "--to", "hf", str(tmp_path / "empty")], capsys, tmp_path, "nothing was written")


def test_missing_safetensors_names_the_extra(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # as if not installed
    _fails([str(run), "--to", "hf", str(tmp_path / "out")], capsys, tmp_path, 'pip install "gradzip[hf]"')


def test_model_card_of_a_run_that_stopped_early(run, exported):
    cfg = json.loads((exported / "config.json").read_text())
    bert = bert_config("bert-tiny", vocab_size=cfg["vocab_size"])
    settings = export._run_config(run)
    card = export.model_card(run, exported, 1, bert, None, {"step": 1, "loss": 9.5, "tokens": 375}, settings)
    assert f"| compressor | `{SPEC}` |" in card and "| steps | not recorded |" in card
    assert "| training loss at step 1 | 9.5000 |" in card and "no summary.json" in card


# ----------------------------------------------------------------------------------------------
# A --pre-ln run exports as RobertaPreLayerNormForMaskedLM


@pytest.fixture(scope="module")
def pre_ln_export(corpus, tmp_path_factory) -> tuple[Path, Path]:
    pytest.importorskip("safetensors", reason="the export needs `pip install gradzip[hf]`")
    run = tmp_path_factory.mktemp("export-preln") / "run"
    assert main(["train", "--model", "bert-tiny", "--pre-ln", "--seq-len", str(SEQ_LEN), "--batch-size", "4",
                 "--workers", "1", "--steps", "2", "--checkpoint-every", "1", "--eval-batches", "1", "--no-progress",
                 "--corpus", str(corpus), "--out", str(run)]) == 0
    assert "pre_ln = true" in (run / "config.toml").read_text()
    return run, export.export_hf(run, run.parent / "hf")


def test_pre_ln_export_is_roberta_prelayernorm(pre_ln_export):
    run, out = pre_ln_export
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"]) == ("roberta-prelayernorm", ["RobertaPreLayerNormForMaskedLM"])
    assert "pre_layer_norm" not in cfg
    # RoBERTa numbers positions from pad + 1: the table is pad + 1 rows longer than gradzip's
    assert cfg["max_position_embeddings"] == max(512, SEQ_LEN) + cfg["pad_token_id"] + 1
    card = (out / "README.md").read_text()
    assert "pre-LN" in card and "RobertaPreLayerNormForMaskedLM.from_pretrained" in card


def test_pre_ln_export_logits_equal_ours(pre_ln_export, data):
    transformers = pytest.importorskip("transformers", reason="loading the export needs `pip install gradzip[hf]`")
    run, out = pre_ln_export
    for cls in (transformers.RobertaPreLayerNormForMaskedLM, transformers.AutoModelForMaskedLM):
        mlm, info = cls.from_pretrained(out, output_loading_info=True)
        assert type(mlm).__name__ == "RobertaPreLayerNormForMaskedLM"
        assert not any(info[k] for k in ("missing_keys", "mismatched_keys", "error_msgs")), info
        assert {k.split(".")[1] for k in info["unexpected_keys"]} <= {"pooler"}  # ForMaskedLM has no pooler
        assert mlm.lm_head.decoder.weight is mlm.roberta_prelayernorm.embeddings.word_embeddings.weight  # tied
    base = transformers.RobertaPreLayerNormModel.from_pretrained(out).eval()  # with the pooler
    batch = next(iter(data.eval_batches(batch_size=4, max_batches=1)))
    inputs = {k: batch[k].clone() for k in ("input_ids", "token_type_ids", "attention_mask")}
    for row, length in ((1, 40), (2, 17)):  # right-padded rows: RoBERTa's position numbering must agree
        inputs["attention_mask"][row, length:] = 0
        inputs["token_type_ids"][row, length:] = 0
        inputs["input_ids"][row, length:] = data.tokenizer.pad_id
    model = ours(run, 2, pre_ln=True)
    with torch.no_grad():
        ref = model(**inputs, full_logits=True)
        seq, pooled = model.bert(inputs["input_ids"], inputs["token_type_ids"], inputs["attention_mask"])
        got = mlm.eval()(**inputs)
        got_base = base(**inputs)
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(got.logits[real], ref.prediction_logits[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(got_base.last_hidden_state[real], seq[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(got_base.pooler_output, pooled, rtol=0, atol=1e-5)
