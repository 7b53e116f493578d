"""Figures and columns for runs that communicate rarely: ``loss_vs_bytes`` (final MLM loss against
bytes per worker, one labelled point per seed group) and the time to target modelled at other
bandwidths (``[target] bandwidths``: the re-timing of :mod:`gradzip.plots.retime`, the
``time_to_target_<B>_s`` columns and the ``time_to_target`` figure).

The run directories are synthetic, in ``gradzip train``'s format, so every number is known.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from test_plots import assert_image

from gradzip.cli import main
from gradzip.errors import SpecError
from gradzip.experiments.spec import load_spec
from gradzip.plots.lowcomm import bytes_points, config_label, pareto_front, target_rows
from gradzip.plots.report import make_report
from gradzip.plots.results import FIGURES, LossTarget, load_runs
from gradzip.plots.retime import bandwidth_columns, retimed_wall, time_to_target_at
from gradzip.plots.seeds import Stat
from gradzip.plots.table import results_csv, results_markdown

B0 = 1e9  # the synthetic runs' own link: 1 Gbit/s
STEPS = 16
COMPUTE, COMPRESS, OPT, LATENCY = 0.05, 0.004, 0.006, 0.001
# label -> (table, bytes per sync, sync every H steps, final MLM loss of seed 0, 1, 2)
METHODS = {
    "step-fp32": ({"compressor": "none"}, 4.0e6, 1, (4.00, 4.02, 4.04)),
    "step-topk": ({"compressor": "topk:ratio=0.01,ef=true"}, 8.0e4, 1, (4.15, 4.17, 4.19)),
    "diloco-h4-fp32": ({"sync": "diloco:every=4", "compressor": "none"}, 4.0e6, 4, (4.10, 4.10, 4.16)),
    "diloco-h4-int8": ({"sync": "diloco:every=4", "compressor": "int8bins"}, 1.0e6, 4, (4.12, 4.15, 4.60)),
    "diloco-h8-int8": ({"sync": "diloco:every=8", "compressor": "int8bins"}, 1.0e6, 8, (5.00, 5.10, 5.20)),
}
TARGET = 4.5  # eval MLM+NSP loss; diloco-h8-int8 never gets there, diloco-h4-int8 only with two seeds


def write_lowcomm_run(d: Path, table: dict, per_sync: float, every: int, final_mlm: float, seed: int) -> None:
    """A run that sends ``per_sync`` bytes every ``every`` steps; its eval loss falls linearly to
    ``final_mlm + 0.3`` at the last step (evals every 4 steps)."""
    d.mkdir(parents=True)
    rows, wall = [], 0.0
    for k in range(1, STEPS + 1):
        sent = per_sync if k % every == 0 else 0.0
        comm = sent * 8 / B0 + LATENCY if sent else 0.0
        step_s = COMPUTE + COMPRESS + comm + OPT
        wall += step_s
        loss = 7.0 - (7.0 - final_mlm - 0.3) * k / STEPS
        row = {"step": k, "loss": loss, "step_s": step_s, "wall_s": wall, "compute_s": COMPUTE,
               "compress_s": COMPRESS, "comm_s": comm, "opt_s": OPT, "bytes_sent": sent, "bytes_inter": sent,
               "syncs": 1 if sent else 0, "samples": 32 * k, "clock": "modelled"}
        if k % 4 == 0:
            row.update(eval_loss=loss, eval_mlm_loss=loss - 0.3)
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": "bert-tiny", "compressor": "none", "sync": "step", "backend": "sim", "workers": 4,
           "bandwidth": "1gbit", "steps": STEPS, "seed": seed, **table}
    (d / "config.toml").write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in cfg.items()))
    total = sum(r["bytes_sent"] for r in rows)
    (d / "summary.json").write_text(json.dumps({
        "steps": STEPS, "final_eval_loss": rows[-1]["eval_loss"], "final_eval_mlm_loss": rows[-1]["eval_mlm_loss"],
        "bytes_total": total, "bytes_per_step": total / STEPS, "syncs": STEPS // every, "wall_s": wall,
        "clock": "modelled", "compressor": cfg["compressor"], "sync": cfg["sync"], "workers": 4,
        "unigram_entropy": 5.4, "context_free_mlm_loss": 4.9}))


def lowcomm_sweep(root: Path, bandwidths: list | None = None) -> Path:
    cells = []
    for seed in range(3):
        for label, (table, per_sync, every, finals) in METHODS.items():
            name = f"method={label}__seed={seed}"
            write_lowcomm_run(root / name, table, per_sync, every, finals[seed], seed)
            cells.append({"name": name, "params": {**table, "seed": seed}, "status": "done"})
    target = {"loss": TARGET, "metric": "eval_loss", "smoothing": 0.9}
    if bandwidths is not None:
        target["bandwidths"] = bandwidths
    spec = {"name": "lowcomm", "grid": {"method": [{"label": k, **v[0]} for k, v in METHODS.items()]},
            "repeats": {"n": 3, "where": None}, "target": target}
    (root / "sweep.json").write_text(json.dumps({"spec": spec, "cells": cells}))
    return root


# ---------------------------------------------------------------------- the re-timing model
def three_step_run(root: Path) -> Path:
    """Hand-computable: 1 Gbit/s; steps 1 and 3 send 5 MB (0.04 s on the link), step 2 nothing.
    Step 1 exposes 0.05 s (link + 0.01 s latency), step 3 only 0.01 s (0.03 s hidden behind backward)."""
    d = root / "three"
    d.mkdir(parents=True)
    rows = [
        {"step": 1, "loss": 5.0, "compute_s": 0.1, "compress_s": 0.01, "opt_s": 0.02, "comm_s": 0.05,
         "bytes_sent": 5e6},
        {"step": 2, "loss": 4.0, "compute_s": 0.1, "compress_s": 0.0, "opt_s": 0.02, "comm_s": 0.0,
         "bytes_sent": 0, "eval_loss": 3.0},
        {"step": 3, "loss": 3.0, "compute_s": 0.1, "compress_s": 0.01, "opt_s": 0.02, "comm_s": 0.01,
         "bytes_sent": 5e6},
    ]
    wall = 0.0
    for r in rows:
        r["step_s"] = r["compute_s"] + r["compress_s"] + r["comm_s"] + r["opt_s"]
        wall += r["step_s"]
        r["wall_s"] = wall
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "config.toml").write_text('compressor = "none"\nbandwidth = "1gbit"\nsteps = 3\n')
    return d


def test_retiming_by_hand_on_three_steps(tmp_path):
    run = load_runs(three_step_run(tmp_path)).runs[0]
    assert run.times() == pytest.approx([0.18, 0.30, 0.44])
    # 100 Mbit/s: each 5 MB step's link time grows by 4e7 bits * (1e-8 - 1e-9) s/bit = 0.36 s
    assert retimed_wall(run, 1e8) == pytest.approx([0.54, 0.66, 1.16])
    # 10 Gbit/s: it shrinks by 0.036 s; step 3's 0.01 s exposed cannot go below 0
    assert retimed_wall(run, 1e10) == pytest.approx([0.144, 0.264, 0.394])
    assert retimed_wall(run, 1e9) == pytest.approx(run.times(), abs=1e-15)  # B = B0: the run's own clock
    loss = LossTarget(3.5, "loss", 0.0)  # raw training loss: reached at step 3
    assert run.time_to_target(loss) == (3, pytest.approx(0.44))
    assert time_to_target_at(run, loss, 1e8) == pytest.approx(1.16)
    assert time_to_target_at(run, loss, 1e9) == pytest.approx(0.44)
    assert time_to_target_at(run, loss, 1e10) == pytest.approx(0.394)
    ev = LossTarget(3.2, "eval_loss")  # the eval at step 2
    assert time_to_target_at(run, ev, 1e8) == pytest.approx(0.66)
    assert time_to_target_at(run, LossTarget(2.0, "loss", 0.0), 1e8) is None  # never reached


def test_runs_that_cannot_be_retimed(tmp_path):
    d = three_step_run(tmp_path)
    (d / "config.toml").write_text('compressor = "none"\nsteps = 3\n')  # no bandwidth: no B0
    assert retimed_wall(load_runs(d).runs[0], 1e8) is None
    (d / "config.toml").write_text('compressor = "none"\nbandwidth = "1gbit"\nsteps = 3\n')
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    del rows[1]["comm_s"]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert retimed_wall(load_runs(d).runs[0], 1e8) is None


def test_bandwidth_columns_and_bad_values():
    assert bandwidth_columns(["100mbit", "1Gb/s", 1e10]) == [
        ("time_to_target_100mbit_s", 1e8), ("time_to_target_1gbit_s", 1e9), ("time_to_target_10gbit_s", 1e10)]
    with pytest.raises(SpecError, match="cannot parse bandwidth 'fast'"):
        bandwidth_columns(["fast"])
    with pytest.raises(SpecError, match="same bandwidth"):
        bandwidth_columns(["1gbit", "125MB/s"])


# ---------------------------------------------------------------------- the spec's [target] bandwidths
SPEC = '[base]\nsteps = 3\n[grid]\ncompressor = ["none"]\n[target]\nloss = 4.0\n'


@pytest.mark.parametrize("line, msg", [
    ('bandwidths = ["fast"]', r"\[target\] bandwidths: cannot parse bandwidth 'fast'"),
    ('bandwidths = ["-1gbit"]', r"\[target\] bandwidths: bandwidth must be positive"),
    ('bandwidths = ["100mbit", "100Mb/s"]', r"\[target\] bandwidths: .* same bandwidth"),
    ('bandwidths = "1gbit"', r"\[target\] 'bandwidths' must be a list"),
    ("bandwidths = [true]", r"\[target\] bandwidths: bandwidth True must be"),
])
def test_bad_target_bandwidths_are_one_line_spec_errors(tmp_path, line, msg):
    p = tmp_path / "s.toml"
    p.write_text(SPEC + line + "\n")
    with pytest.raises(SpecError, match=msg) as e:
        load_spec(p)
    assert "\n" not in str(e.value) and str(p) in str(e.value)


def test_spec_carries_bandwidths_and_names_the_new_figures(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text(SPEC + 'bandwidths = ["100mbit", "1gbit"]\n[plot]\nfigures = ["loss_vs_bytes", "time_to_target"]\n')
    spec = load_spec(p)
    assert spec.target.bandwidths == ["100mbit", "1gbit"]
    assert spec.to_json()["target"]["bandwidths"] == ["100mbit", "1gbit"]
    assert {"loss_vs_bytes", "time_to_target"} <= set(FIGURES)


# ---------------------------------------------------------------------- loss against bytes
def test_loss_vs_bytes_points_labels_and_seed_spread(tmp_path):
    col = load_runs(lowcomm_sweep(tmp_path / "sw"))
    points, silent = bytes_points(col)
    assert [p.config.label for p in points] == list(METHODS) and silent == []
    for p in points:
        _, per_sync, every, finals = METHODS[p.config.label]
        assert p.bytes.mean == pytest.approx(per_sync * (STEPS // every)) and p.bytes.error() is None
        assert p.loss.values == pytest.approx(finals) and len(p.config.runs) == 3
        assert p.loss.error() == pytest.approx((p.loss.mean - min(finals), max(finals) - p.loss.mean))  # min–max
    # no other configuration sends less and does better than these
    assert [p.config.label for p in pareto_front(points)] == ["step-topk", "diloco-h4-fp32", "step-fp32"]
    rep = make_report(col.root, figures=["loss_vs_bytes"])
    (d,) = rep.figures
    assert_image(next(p for p in d.paths if p.suffix == ".png"))
    assert "min–max over 3 seeds" in d.caption and "step-topk, diloco-h4-fp32, step-fp32" in d.caption
    assert "unigram entropy H = 5.40" in d.caption


def test_config_label_without_labelled_tables(tmp_path):
    root = lowcomm_sweep(tmp_path / "sw")
    sweep = json.loads((root / "sweep.json").read_text())
    sweep["spec"]["grid"] = {"method": [v[0] for v in METHODS.values()]}  # tables without labels
    (root / "sweep.json").write_text(json.dumps(sweep))
    col = load_runs(root)
    run = next(r for r in col.runs if r.name.startswith("method=diloco-h4-int8"))
    assert config_label(run, col) == "sync=diloco:every=4, compressor=int8bins"
    del sweep["spec"]["grid"]  # no spec grid at all: compressor, then what else varies
    (root / "sweep.json").write_text(json.dumps(sweep))
    col = load_runs(root)
    run = next(r for r in col.runs if r.name.startswith("method=diloco-h4-int8"))
    assert config_label(run, col) == "int8bins · sync=diloco:every=4"


def test_error_bars_follow_the_table_rule():
    assert Stat([1.0, 2.0, 3.0, 4.0]).error() == pytest.approx((1.2910, 1.2910), abs=1e-4)  # ± std
    assert Stat([1.0, 3.0]).error() == (1.0, 1.0) and Stat([2.0]).error() is None


def test_loss_vs_bytes_is_skipped_without_bytes_total(tmp_path):
    root = lowcomm_sweep(tmp_path / "sw")
    for d in root.glob("method=*"):
        s = json.loads((d / "summary.json").read_text())
        del s["bytes_total"]
        (d / "summary.json").write_text(json.dumps(s))
    rep = make_report(root)
    assert ("loss_vs_bytes", "no run has both bytes_total and final_eval_mlm_loss in its summary.json") in rep.skipped


# ---------------------------------------------------------------------- time to target at other bandwidths
def test_time_to_target_columns_and_rows(tmp_path):
    col = load_runs(lowcomm_sweep(tmp_path / "sw", ["100mbit", "1gbit"]))
    rows = {r.config.label: r for r in target_rows(col, col.target)}
    assert [(rows[k].reached, rows[k].seeds) for k in METHODS] == [(3, 3), (3, 3), (3, 3), (2, 3), (0, 3)]
    for r in rows.values():
        slow, own = r.times["time_to_target_100mbit_s"], r.times["time_to_target_1gbit_s"]
        if r.reached == 0:
            assert not slow.values and not own.values
            continue
        runs = [x for x in r.config.runs if x.time_to_target(col.target)]
        assert own.values == pytest.approx([x.time_to_target(col.target)[1] for x in runs])  # B = B0
        assert all(s > o for s, o in zip(slow.values, own.values))  # a slower link: later
    # 100 Mbit/s costs each sync 8 bits/B * (1e-8 - 1e-9) s per byte more, for every sync up to the target
    fp32 = rows["step-fp32"]
    step = fp32.steps.values[0]
    assert fp32.times["time_to_target_100mbit_s"].values[0] - fp32.times["time_to_target_1gbit_s"].values[0] == \
        pytest.approx(step * 4.0e6 * 8 * (1e-8 - 1e-9))

    table = {(r["compressor"], r["sync"]): r for r in csv.DictReader(io.StringIO(results_csv(col)))}
    header = next(iter(table.values())).keys()
    assert {"time_to_target_100mbit_s", "time_to_target_100mbit_s_min", "time_to_target_1gbit_s_max"} <= set(header)
    never = table[("int8bins", "diloco:every=8")]
    assert never["time_to_target_100mbit_s"] == "" and never["time_to_target_s"] == ""
    topk = table[("topk:ratio=0.01,ef=true", "step")]
    assert float(topk["time_to_target_100mbit_s"]) == pytest.approx(rows["step-topk"].times[
        "time_to_target_100mbit_s"].mean)
    md = results_markdown(col)
    assert "time to target @ 100mbit (s)" in md and "time to target @ 1gbit (s)" in md
    assert "re-timed step by step" in md


def test_time_to_target_figure_shows_unreached_configurations(tmp_path):
    root = lowcomm_sweep(tmp_path / "sw", ["100mbit", "1gbit", "10gbit"])
    rep = make_report(root)
    drawn = {d.name: d for d in rep.figures}
    assert {"loss_vs_bytes", "time_to_target"} <= set(drawn), rep.skipped
    for name in ("loss_vs_bytes", "time_to_target"):
        assert_image(next(p for p in drawn[name].paths if p.suffix == ".png"))
    cap = drawn["time_to_target"].caption
    assert "Never reached: diloco-h8-int8." in cap
    assert "Reached by some seeds only (hollow markers: their mean): diloco-h4-int8 (2/3)." in cap
    assert "re-timed step by step" in cap and "modelled" in cap
    csv_header = (root / "results.csv").read_text().splitlines()[0]
    assert "time_to_target_10gbit_s" in csv_header


def test_time_to_target_needs_bandwidths_and_the_cli_flag_gives_them(tmp_path, capsys):
    root = lowcomm_sweep(tmp_path / "sw")  # [target] without bandwidths
    rep = make_report(root)
    assert any(n == "time_to_target" and "no bandwidths" in why for n, why in rep.skipped)
    assert main(["plot", str(root), "--target-bandwidths", "100mbit,1gbit", "--figures", "time_to_target"]) == 0
    assert "figure time_to_target: " in capsys.readouterr().out
    assert "time_to_target_100mbit_s" in (root / "results.csv").read_text().splitlines()[0]
    assert main(["plot", str(root), "--target-bandwidths", "100mbit,slow"]) == 2
    err = capsys.readouterr().err.strip()
    assert "target bandwidths: cannot parse bandwidth 'slow'" in err and "\n" not in err


def test_cli_bandwidths_without_a_target_is_one_line(tmp_path, capsys):
    root = three_step_run(tmp_path)
    assert main(["plot", str(root), "--target-bandwidths", "100mbit"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--target-bandwidths needs a target loss" in err and "\n" not in err
    # EMA 0.9 of 5, 4, 3 (bias-corrected): 5, 4.47, ... reaches 4.5 at step 2
    assert main(["plot", str(root), "--target", "4.5", "--target-bandwidths", "100mbit",
                 "--figures", "loss_steps"]) == 0
    row = next(csv.DictReader(io.StringIO((root / "results.csv").read_text())))
    assert row["steps_to_target"] == "2" and float(row["time_to_target_s"]) == pytest.approx(0.30)
    assert float(row["time_to_target_100mbit_s"]) == pytest.approx(0.66)
