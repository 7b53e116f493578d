"""Seeds: `repeats` in a spec, the results table aggregated over seeds (mean and spread, Δ vs none
against the seed spread), seed bands and metric figures with their reference lines, and the
unigram reference that `gradzip train` reports."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
from test_plots import assert_image

from gradzip.data.pretrain import UnigramReference
from gradzip.errors import SpecError
from gradzip.experiments.spec import load_spec
from gradzip.plots.report import make_report
from gradzip.plots.results import is_figure, load_runs, metric_figure, reference
from gradzip.plots.seeds import Stat, exceeds_spread, stat
from gradzip.plots.table import results_csv, results_markdown


def test_repeats_every_cell_and_only_some(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('repeats = 3\n[base]\nsteps = 3\n[grid]\ncompressor = ["none", "fp16"]\n')
    spec = load_spec(p)
    assert [(c.name, c.config["seed"]) for c in spec.cells] == [  # seed by seed
        ("compressor=none__seed=0", 0), ("compressor=fp16__seed=0", 0), ("compressor=none__seed=1", 1),
        ("compressor=fp16__seed=1", 1), ("compressor=none__seed=2", 2), ("compressor=fp16__seed=2", 2)]
    assert all(c.params["seed"] == c.config["seed"] for c in spec.cells)
    p = tmp_path / "t.toml"
    p.write_text('repeats = { n = 2, where = { compressor = ["none", "onebit"] } }\n'
                 '[base]\nseed = 7\n[grid]\ncompressor = ["none", "fp16", "onebit"]\n')
    names = [c.name for c in load_spec(p).cells]
    assert names == ["compressor=none__seed=7", "compressor=fp16__seed=7", "compressor=onebit__seed=7",
                     "compressor=none__seed=8", "compressor=onebit__seed=8"]


@pytest.mark.parametrize("text, msg", [
    ('repeats = 2\n[grid]\nseed = [0, 1]\n', "seed is a \\[grid\\] axis and repeats is set"),
    ('repeats = 0\n[grid]\nlr = [1e-3]\n', "'repeats' must be from 1 to 100"),
    ('repeats = "3"\n[grid]\nlr = [1e-3]\n', "'repeats' must be a whole number"),
    ('repeats = { m = 3 }\n[grid]\nlr = [1e-3]\n', "unknown key 'm' in repeats"),
    ('repeats = { where = { lr = 1e-3 } }\n[grid]\nlr = [1e-3]\n', "repeats needs 'n'"),
    ('repeats = { n = 2, where = { compressor = "zip" } }\n[grid]\nlr = [1e-3]\n', "matches no cell"),
])
def test_bad_repeats(tmp_path, text, msg):
    p = tmp_path / "s.toml"
    p.write_text(text)
    with pytest.raises(SpecError, match=msg) as e:
        load_spec(p)
    assert "\n" not in str(e.value)


def test_stat_text_and_spread_rule():
    f = "{:.2f}".format
    assert stat([1.0]).text(f) == "1.00"
    assert stat([1.0, 2.0, None]).text(f) == "1.50 (1.00–2.00)"
    assert stat([1.0, 2.0, 3.0, 4.0]).text(f) == "2.50 ± 1.29"
    assert stat([]).text(f) == "—"
    assert stat([3.0, 3.0, 3.0]).text(f) == "3.00"  # every seed alike: no range
    a, b = Stat([7.0, 7.2]), Stat([7.5, 7.55])
    assert exceeds_spread(b, a) is True  # |0.425| > 0.2
    assert exceeds_spread(Stat([7.15]), a) is False  # |0.05| <= 0.2
    assert exceeds_spread(Stat([7.0]), Stat([9.0])) is None  # no seed spread known


def write(d: Path, compressor: str, seed: int, final: float, acc: float) -> None:
    d.mkdir(parents=True)
    rows = []
    for k in range(1, 21):
        r = {"step": k, "loss": 9.0 - 0.05 * k + 0.01 * seed, "wall_s": 0.1 * k, "samples": 8 * k,
             "bytes_sent": 100, "clock": "modelled", "mlm_loss": 8.0 - 0.05 * k}
        if k % 5 == 0:
            r.update(eval_loss=final + (20 - k) * 0.01, eval_mlm_loss=final - 0.7 + (20 - k) * 0.01,
                     eval_mlm_acc=acc - (20 - k) * 0.001)
        rows.append(r)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "config.toml").write_text(f'compressor = "{compressor}"\nseed = {seed}\nsteps = 20\n')
    (d / "summary.json").write_text(json.dumps({
        "final_eval_loss": final, "final_eval_mlm_acc": acc, "final_eval_nsp_acc": 0.6, "steps": 20,
        "compressor": compressor, "bytes_per_step": 100.0, "compression_ratio": 1.0, "wall_s": 2.0,
        "unigram_entropy": 6.5, "top_token_rate": 0.05, "context_free_mlm_loss": 6.0,
        "context_free_mlm_acc": 0.14}))


def seeded_sweep(root: Path) -> Path:
    finals = {"none": [7.0, 7.1, 7.2], "topk": [7.5, 7.6, 7.55], "fp16": [7.05]}
    cells = []
    for c, vals in finals.items():
        for s, v in enumerate(vals):
            name = f"compressor={c}__seed={s}"
            write(root / name, c, s, v, acc=0.3 - (v - 7.0) / 10)
            cells.append({"name": name, "params": {"compressor": c, "seed": s}, "status": "done"})
    spec = {"name": "seeded", "grid": {"compressor": list(finals)}, "repeats": {"n": 3, "where": None}}
    (root / "sweep.json").write_text(json.dumps({"spec": spec, "cells": cells}))
    return root


def test_results_table_aggregates_seeds(tmp_path):
    col = load_runs(seeded_sweep(tmp_path / "sw"))
    md = results_markdown(col)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in md.splitlines() if line.startswith("| `")}
    header = [c.strip() for c in md.splitlines()[0].split("|")[1:-1]]
    assert header[:9] == ["compressor", "seeds", "final eval loss", "Δ vs none", "Δ per seed", "Δ mean [95% CI]",
                          "verdict", "MLM loss", "MLM acc"]  # the paired columns: tests/test_paired.py
    assert rows["`none`"][1:4] == ["3", "7.1 (7–7.2)", "baseline"]
    assert rows["`topk`"][2:4] == ["7.55 (7.5–7.6)", "+0.4500 (> spread 0.2000)"]
    assert rows["`fp16`"][2:4] == ["7.05", "-0.0500 (within spread 0.2000)"]
    assert "3 configuration(s), 7 runs" in md and "wider min–max range" in md
    table = list(csv.DictReader(io.StringIO(results_csv(col))))
    topk = next(r for r in table if r["compressor"] == "topk")
    assert float(topk["final_eval_loss"]) == pytest.approx(7.55)
    assert float(topk["final_eval_loss_min"]) == 7.5 and float(topk["final_eval_loss_max"]) == 7.6
    assert float(topk["final_eval_loss_std"]) == pytest.approx(0.05)
    assert topk["delta_exceeds_spread"] == "True" and topk["seeds"] == "3"


def test_metric_figures_bands_and_references(tmp_path):
    root = seeded_sweep(tmp_path / "sw")
    assert metric_figure("eval_mlm_acc_steps") == ("eval_mlm_acc", "steps")
    assert metric_figure("grad_norm_time") == ("grad_norm", "time")
    assert metric_figure("eval_loss_bytes") == ("eval_loss", "bytes")
    assert not is_figure("accuracy_steps") and is_figure("loss_steps")
    col = load_runs(root)
    assert reference(col.runs, "eval_mlm_loss") == [(6.5, "unigram entropy H = 6.50 (no context)"),
                                                    (6.0, "context-free floor 6.00 (H, less copying the input token)")]
    assert [v for v, _ in reference(col.runs, "eval_mlm_acc")] == pytest.approx([0.05, 0.14])
    assert [v for v, _ in reference(col.runs, "loss")] == pytest.approx([6.5 + 0.6931, 6.0 + 0.6931], abs=1e-4)
    assert reference(col.runs, "grad_norm") == []
    names = ["eval_mlm_acc_steps", "eval_mlm_loss_steps", "mlm_loss_time", "loss_steps", "eval_mlm_loss_bytes"]
    rep = make_report(root, figures=names)
    drawn = {d.name: d for d in rep.figures}
    assert set(drawn) == set(names), rep.skipped
    for d in drawn.values():
        assert_image(next(p for p in d.paths if p.suffix == ".png"))
    assert "mean of 3 seeds" in drawn["eval_mlm_acc_steps"].caption
    assert "most frequent token 0.050" in drawn["eval_mlm_acc_steps"].caption
    assert "unigram entropy H = 6.50" in drawn["eval_mlm_loss_steps"].caption
    assert "Dotted: context-free floor 6.00" in drawn["eval_mlm_loss_steps"].caption
    assert "unigram plateau H + ln 2" in drawn["loss_steps"].caption
    assert "context-free floor + ln 2 = 6.69" in drawn["loss_steps"].caption
    assert "modelled" in drawn["mlm_loss_time"].caption
    assert "cumulative bytes each worker sent" in drawn["eval_mlm_loss_bytes"].caption
    # the default set includes the accuracy figures when the runs have them
    assert {"eval_mlm_acc_steps", "eval_mlm_loss_steps"} <= {d.name for d in make_report(root).figures}


def test_bad_figure_name_is_one_line(tmp_path, capsys):
    from gradzip.cli import main
    root = seeded_sweep(tmp_path / "sw")
    assert main(["plot", str(root), "--figures", "accuracy_steps"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown figure 'accuracy_steps'" in err and "METRIC_steps" in err and "\n" not in err


def test_train_reports_the_unigram_reference(tmp_path, corpus):
    from gradzip.data.pretrain import PretrainData
    data = PretrainData.build(corpus, seq_len=64, progress=False)
    ref = data.unigram_reference()
    # recount from the examples, independently: token frequencies of the real, non-special tokens
    ids = np.concatenate([np.asarray(data.train.ids[i, :data.train.length[i]]) for i in range(len(data.train))])
    ids = ids[~np.isin(ids, np.asarray(data.tokenizer.special_ids))]
    p = np.bincount(ids) / ids.size
    p = p[p > 0]
    assert ref.entropy == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-9)
    assert ref.top_rate == pytest.approx(float(p.max()))
    assert 0 < ref.top_rate < ref.floor_acc < 1 and 0 < ref.floor < ref.entropy < np.log(data.vocab_size)


def test_context_free_floor_is_the_bayes_loss_under_bert_masking():
    """Monte Carlo: draw labels from p, mask them 80/10/10 as BERT does, score the Bayes predictor
    that sees only the input token; its mean log-loss and accuracy are the floor's."""
    rng = np.random.default_rng(0)
    V = 40
    counts = np.concatenate([rng.integers(1, 1000, V - 3) ** 2, [0, 0, 0]])  # 3 tokens never seen
    ref = UnigramReference.from_counts(counts, V)
    p = counts / counts.sum()
    n = 400_000
    y = rng.choice(V, size=n, p=p)
    u = rng.random(n)
    x = np.where(u < 0.8, -1, np.where(u < 0.9, rng.integers(0, V, n), y))  # -1 = [MASK]
    xs = np.where(x < 0, 0, x)
    # P(y | x): [MASK] -> p; else ∝ p_y (0.1 [y = x] + 0.1 / V)
    post = p[None, :] * (0.1 * (np.arange(V)[None, :] == xs[:, None]) + 0.1 / V)
    post = np.where((x < 0)[:, None], p[None, :], post / post.sum(axis=1, keepdims=True))
    loss = -np.log(post[np.arange(n), y]).mean()
    acc = (post.argmax(axis=1) == y).mean()
    assert loss == pytest.approx(ref.floor, abs=0.01)
    assert acc == pytest.approx(ref.floor_acc, abs=0.005)
    assert ref.floor < ref.entropy
