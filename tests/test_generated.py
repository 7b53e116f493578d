"""The calibrated tier's generated language: the exact optimum against brute force, and the data
contract training relies on (pure batches, paired seeds, fixed held-out set)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from gradzip.data.generated import GeneratedData, is_generated
from gradzip.data.hmm import HMMLanguage, HMMSpec, entropy
from gradzip.errors import GradzipError


def _tiny() -> HMMLanguage:
    A = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.25, 0.25]])
    B = np.array([[0.6, 0.3, 0.1, 0.0], [0.1, 0.1, 0.4, 0.4], [0.25, 0.25, 0.25, 0.25]])
    return HMMLanguage(A, B)


def _brute(lang: HMMLanguage, words: np.ndarray, masked: np.ndarray) -> list[float]:
    """P(word_t | unmasked words) by summing the joint over every hidden path and masked word."""
    n = words.size
    out = []
    for t in np.nonzero(masked)[0]:
        num = den = 0.0
        hidden_masked = [i for i in np.nonzero(masked)[0]]
        for z in itertools.product(range(lang.states), repeat=n):
            p_path = lang.pi[z[0]] * math.prod(lang.A[z[i - 1], z[i]] for i in range(1, n))
            p_obs = math.prod(lang.B[z[i], words[i]] for i in range(n) if not masked[i])
            # the other masked positions are summed out (their emissions sum to 1)
            den += p_path * p_obs
            num += p_path * p_obs * lang.B[z[t], words[t]]
        assert hidden_masked
        out.append(-math.log(num / den))
    return out


def test_stationary_start_is_stationary() -> None:
    lang = _tiny()
    np.testing.assert_allclose(lang.pi @ lang.A, lang.pi, atol=1e-12)
    assert lang.pi.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("mask", [[0, 1, 0, 0, 0], [1, 0, 0, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
def test_posterior_loss_equals_brute_force(mask: list[int]) -> None:
    lang = _tiny()
    rng = np.random.default_rng(3)
    words = lang.sample(6, 5, rng)
    masked = np.array([mask] * 6, dtype=bool)
    got = lang.posterior_loss(words, masked)
    want = [v for row in words for v in _brute(lang, row, masked[0])]
    np.testing.assert_allclose(got, want, rtol=1e-10)


def test_all_masked_is_the_unigram() -> None:
    lang = _tiny()
    words = np.array([[0, 3, 1]])
    got = lang.posterior_loss(words, np.ones((1, 3), bool))
    np.testing.assert_allclose(got, -np.log(lang.unigram()[[0, 3, 1]]), rtol=1e-10)


def test_samples_follow_the_language() -> None:
    lang = _tiny()
    w = lang.sample(20000, 3, np.random.default_rng(0))
    freq = np.bincount(w[:, 1], minlength=4) / w.shape[0]
    np.testing.assert_allclose(freq, lang.unigram(), atol=0.015)
    # pairs: P(w1 = a, w2 = b) = sum_z,z' pi_z B[z,a] A[z,z'] B[z',b]
    joint = (lang.pi[:, None] * lang.B).T @ lang.A @ lang.B
    emp = np.zeros((4, 4))
    np.add.at(emp, (w[:, 0], w[:, 1]), 1)
    np.testing.assert_allclose(emp / w.shape[0], joint, atol=0.015)


def test_default_language_meets_the_tier_margins() -> None:
    """The shipped language: the optimum lies >= 1.5 nat below the unigram entropy."""
    data = GeneratedData.build("hmm", seq_len=64)
    h = data.unigram_reference().entropy
    assert h == pytest.approx(entropy(data.language.unigram()))
    opt = data.optimal_mlm_loss(batch_size=8, max_batches=40)
    assert h - opt >= 1.5


def test_batches_are_pure_and_paired() -> None:
    data = GeneratedData.build("hmm:states=8,words=64", seq_len=16)
    a = data.batch("train", step=5, worker=1, num_workers=2, batch_size=4, seed=7, mask_prob=0.3)
    b = data.batch("train", step=5, worker=1, num_workers=2, batch_size=4, seed=7, mask_prob=0.3)
    c = data.batch("train", step=5, worker=1, num_workers=2, batch_size=4, seed=8, mask_prob=0.3)
    for k in a:
        assert torch.equal(a[k], b[k])
    assert not torch.equal(a["labels"], c["labels"])
    tok = data.tokenizer
    ids, labels = a["input_ids"], a["labels"]
    assert (ids[:, 0] == tok.cls_id).all() and (ids[:, -1] == tok.sep_id).all()
    sel = labels != -100
    assert (ids[sel] == tok.mask_id).all()  # [MASK] at every selected position, nothing else
    assert (sel.sum(1) == round(0.3 * 14)).all()
    assert "next_sentence_label" not in a


def test_optimum_matches_the_eval_batches() -> None:
    """The optimum is the mean of per-batch means over exactly the evaluated batches."""
    data = GeneratedData.build("hmm:states=8,words=64", seq_len=16)
    per_batch = []
    for batch in data.eval_batches(batch_size=8, max_batches=3):
        sel = batch["labels"] != -100
        assert (batch["input_ids"][sel] == data.tokenizer.mask_id).all()
        words = (batch["labels"][:, 1:-1].numpy() - 5).clip(0)
        observed = batch["input_ids"][:, 1:-1].numpy() - 5
        words = np.where(sel[:, 1:-1].numpy(), words, observed)
        per_batch.append(data.language.posterior_loss(words, sel[:, 1:-1].numpy()).mean())
    assert data.optimal_mlm_loss(batch_size=8, max_batches=3) == pytest.approx(float(np.mean(per_batch)), rel=1e-12)


def test_tokenizer_reads_the_words() -> None:
    data = GeneratedData.build("hmm:states=4,words=32", seq_len=8)
    assert data.tokenizer.encode("w3 w17", special_tokens=False) == [8, 22]
    assert data.vocab_size == 37


@pytest.mark.parametrize("spec,msg", [
    ("hmm:states=0", "states >= 1"), ("hmm:bogus=1", "bad hmm option"), ("hmm:words=x", "must be a whole number"),
    ("hmm:branch=40", "branch"), ("hmm:leak=2", "leak"),
])
def test_bad_specs(spec: str, msg: str) -> None:
    with pytest.raises(GradzipError, match=msg):
        HMMSpec.parse(spec)


def test_vocab_size_must_match() -> None:
    with pytest.raises(GradzipError, match="does not match"):
        GeneratedData.build("hmm:words=64,states=8", seq_len=16, vocab_size=100)
    assert is_generated("hmm") and is_generated("hmm:states=4") and not is_generated("hmmm") \
        and not is_generated(None)


def test_training_reports_the_excess_loss(tmp_path) -> None:
    """A run on the generated language: every evaluation's excess loss is its MLM loss minus the
    optimum of the same held-out batches; the export's tokenizer reads the words."""
    from gradzip.training.config import TrainConfig
    from gradzip.training.export import export_hf
    from gradzip.training.loop import train

    cfg = TrainConfig(corpus="hmm:states=4,words=60", model="bert-tiny", backend="sim", workers=2, seq_len=16,
                      batch_size=4, steps=4, eval_every=2, eval_batches=3, checkpoint_every=4, lr=2e-3,
                      warmup=1, progress=False, out=str(tmp_path / "run"))
    summary = train(cfg)
    data = GeneratedData.build(cfg.corpus, seq_len=16)
    opt = data.optimal_mlm_loss(batch_size=4, max_batches=3)
    assert summary["optimal_mlm_loss"] == pytest.approx(opt, rel=1e-12)
    assert summary["final_eval_excess_loss"] == pytest.approx(summary["final_eval_mlm_loss"] - opt, rel=1e-9)
    assert summary["context_free_mlm_loss"] == pytest.approx(summary["unigram_entropy"])
    assert summary["final_eval_nsp_acc"] is None
    export_hf(tmp_path / "run", tmp_path / "hf")
    from transformers import BertTokenizerFast

    tok = BertTokenizerFast.from_pretrained(tmp_path / "hf")
    assert tok("w3 w17", add_special_tokens=False)["input_ids"] == [8, 22]


def test_a_seed_pairs_runs_across_compressors(tmp_path) -> None:
    """The same seed gives every compressor the same initial weights and the same batches: the
    initial held-out loss and the first step's training loss (computed before any exchange) are
    equal bit for bit; another seed changes both."""
    import json

    from gradzip.training.config import TrainConfig
    from gradzip.training.loop import train

    def run(compressor: str, seed: int) -> tuple[float, float]:
        out = tmp_path / f"{compressor.split(':')[0]}-{seed}"
        train(TrainConfig(corpus="hmm:states=4,words=60", model="bert-tiny", backend="sim", workers=2, seq_len=16,
                          batch_size=4, steps=2, eval_every=0, eval_batches=2, checkpoint_every=0, lr=2e-3,
                          warmup=1, progress=False, compressor=compressor, seed=seed, out=str(out)))
        first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        return json.loads((out / "summary.json").read_text())["initial_eval_loss"], first["loss"]

    a, b, c = run("none", 3), run("topk:ratio=0.1,ef=true", 3), run("none", 4)
    assert a == b
    assert a[0] != c[0] and a[1] != c[1]
