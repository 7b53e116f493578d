"""``gradzip plot``: figures from run and sweep directories, captions, and the results table.

The multi-run data here is synthetic (written in the documented run-directory format, so every
number is known); ``tests/test_sweep.py`` plots a real tiny sweep.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

from gradzip.cli import main
from gradzip.cluster.schedule import BucketTiming, model_step
from gradzip.plots.cost import crossover
from gradzip.plots.report import make_report
from gradzip.plots.results import FIGURES, LossTarget, load_runs
from gradzip.plots.table import results_csv, results_markdown

RATIO = {"none": 1.0, "fp16": 2.0, "topk:ratio=0.01,ef=true": 50.0}
FULL_BYTES = 4.0e6


def write_run(d: Path, compressor: str, bandwidth: str, workers: int, steps: int = 30, seed: int = 0,
              clock: str = "modelled") -> dict:
    """A run directory in `gradzip train`'s format, with a loss curve and α–β-like step times."""
    d.mkdir(parents=True)
    bps = float(bandwidth.replace("gbit", "e9").replace("mbit", "e6"))
    sent = FULL_BYTES * 2 * (workers - 1) / workers / RATIO[compressor]
    comm = sent * 8 / bps
    batch, rows, wall, samples = 8, [], 0.0, 0
    rng = np.random.default_rng(seed)
    for k in range(1, steps + 1):
        step_s = 0.05 + 0.002 + comm + 0.005
        wall += step_s
        samples += batch * workers
        loss = 8.0 * math.exp(-k / 15) + 2.0 + 0.05 * rng.random() + 0.1 * math.log(RATIO[compressor])
        row = {"step": k, "loss": loss, "lr": 1e-3, "tokens": samples * 30, "samples": samples, "step_s": step_s,
               "wall_s": wall, "compute_s": 0.05, "compress_s": 0.002, "comm_s": comm, "opt_s": 0.005,
               "bytes_sent": sent, "clock": clock}
        if k % 10 == 0:
            row["eval_loss"] = loss + 0.1
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "config.toml").write_text(
        f'model = "bert-tiny"\ncompressor = "{compressor}"\nbackend = "sim"\nworkers = {workers}\n'
        f'bandwidth = "{bandwidth}"\nbatch_size = {batch}\nseq_len = 32\nsteps = {steps}\nseed = {seed}\n')
    summary = {"final_loss": rows[-1]["loss"], "final_eval_loss": rows[-1]["eval_loss"],
               "final_eval_mlm_loss": rows[-1]["eval_loss"] - 0.7, "bytes_total": sent * steps, "steps": steps,
               "samples": samples, "tokens": samples * 30, "tokens_per_s": samples * 30 / wall,
               "bytes_per_step": sent, "compression_ratio": (FULL_BYTES * 2 * (workers - 1) / workers / sent)
               if sent else None, "wall_s": wall, "clock": clock, "compressor": compressor, "workers": workers}
    (d / "summary.json").write_text(json.dumps(summary))
    m = model_step(0.05, [BucketTiming(0.02, 0.001, [comm / 2]), BucketTiming(0.04, 0.001, [comm / 2], [], 0.001)])
    (d / "schedule.json").write_text(json.dumps({"step": steps, "clock": clock, "step_s": m.step_s,
                                                 "spans": [sp.to_dict() for sp in m.spans]}))
    return summary


def write_sweep(root: Path, target: dict | None = None) -> Path:
    cells = []
    for c in RATIO:
        for bw in ("100mbit", "1gbit", "10gbit"):
            for n in (1, 4):
                name = f"c={c.replace(':', '-').replace(',', '-')}__bw={bw}__n={n}"
                write_run(root / name, c, bw, n)
                cells.append({"name": name, "params": {"compressor": c, "bandwidth": bw, "workers": n},
                              "status": "done"})
    spec = {"name": "synthetic", "grid": {"compressor": list(RATIO), "bandwidth": ["100mbit", "1gbit", "10gbit"],
                                          "workers": [1, 4]}, "target": target,
            "plot": {"captions": {"loss_steps": "My own caption."}}}
    (root / "sweep.json").write_text(json.dumps({"spec": spec, "cells": cells}))
    return root


def assert_image(path: Path, min_kb: float = 8.0) -> None:
    assert path.is_file() and path.stat().st_size > min_kb * 1024, path
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert float(np.var(img[..., :3])) > 1e-3, f"{path} looks blank"


def test_sweep_directory_gives_every_figure_and_captions(tmp_path):
    root = write_sweep(tmp_path / "sweep", target={"loss": 3.0, "metric": "eval_loss", "smoothing": 0.9,
                                                   "bandwidths": ["100mbit", "10gbit"]})
    rep = make_report(root)
    # every figure but policy (--compressor auto runs: tests/test_auto_train.py), downstream_vs_bytes
    # ([downstream] sweeps: tests/test_downstream.py) and delta_ci (seed groups: tests/test_paired.py)
    assert {d.name for d in rep.figures} == set(FIGURES) - {"policy", "downstream_vs_bytes", "delta_ci"}, rep.skipped
    for d in rep.figures:
        png, pdf = (next(p for p in d.paths if p.suffix == s) for s in (".png", ".pdf"))
        assert_image(png)
        assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 4096
    md = (root / "figures" / "figures.md").read_text()
    assert "My own caption." in md  # the spec's caption wins ...
    # ... and every figure with a time axis says which clock it is on.
    for d in rep.figures:
        if d.name in ("loss_time", "throughput_bandwidth", "step_time", "schedule", "scaling", "time_to_target"):
            assert "modelled" in d.caption, d.name
    # one worker sends nothing: those runs have no place on loss_vs_bytes's log axis, and it says so
    lvb = next(d for d in rep.figures if d.name == "loss_vs_bytes")
    assert "Not shown (sent no bytes" in lvb.caption and "none · bandwidth=100mbit, workers=1" in lvb.caption
    thr = next(d for d in rep.figures if d.name == "throughput_bandwidth")
    assert "stops paying" in thr.caption or "pays at every bandwidth" in thr.caption


def test_results_table_matches_summaries(tmp_path):
    root = write_sweep(tmp_path / "sweep", target={"loss": 3.0, "metric": "eval_loss", "smoothing": 0.9})
    col = load_runs(root)
    rows = list(csv.DictReader(io.StringIO(results_csv(col))))
    assert len(rows) == 18
    by_name = {r["run"]: r for r in rows}
    for name, row in by_name.items():
        s = json.loads((root / name / "summary.json").read_text())
        assert float(row["final_eval_loss"]) == pytest.approx(s["final_eval_loss"], rel=1e-12)
        assert float(row["mb_per_step"]) == pytest.approx(s["bytes_per_step"] / 1e6, rel=1e-12)
        # steady state: from the end of step 1 to the end
        m1 = json.loads((root / name / "metrics.jsonl").read_text().splitlines()[0])
        sps = (s["samples"] - m1["samples"]) / (s["wall_s"] - m1["wall_s"])
        assert float(row["samples_per_s"]) == pytest.approx(sps, rel=1e-12)
        if s["compression_ratio"] is None:
            assert row["compression_ratio"] == ""
        else:
            assert float(row["compression_ratio"]) == pytest.approx(s["compression_ratio"], rel=1e-12)
        base = by_name[name.replace(name.split("__")[0], "c=none")]
        delta = s["final_eval_loss"] - float(base["final_eval_loss"])
        assert float(row["delta_vs_none"]) == pytest.approx(delta, abs=1e-12)
        # time to target: the first eval at or below 3.0, from metrics.jsonl
        evals = [json.loads(ln) for ln in (root / name / "metrics.jsonl").read_text().splitlines()]
        hit = next((m for m in evals if m.get("eval_loss") is not None and m["eval_loss"] <= 3.0), None)
        if hit is None:
            assert row["time_to_target_s"] == ""
        else:
            assert int(row["steps_to_target"]) == hit["step"]
            assert float(row["time_to_target_s"]) == pytest.approx(hit["wall_s"], rel=1e-12)
    md = results_markdown(col)
    assert md.count("\n| ") == 18  # header + one row per run (separator starts with "|-")
    assert "baseline" in md and "time to target" in md


def test_single_run_draws_what_it_can_and_says_what_it_skips(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, "topk:ratio=0.01,ef=true", "1gbit", 4, clock="measured")
    assert main(["plot", str(run), "--target", "4.0"]) == 0
    out = capsys.readouterr().out
    assert "skipped figure throughput_bandwidth: the runs have fewer than two bandwidths" in out
    assert "skipped figure scaling" in out
    for name in ("loss_steps", "loss_time", "step_time"):
        assert_image(run / "figures" / f"{name}.png")
    md = (run / "figures" / "figures.md").read_text()
    assert "measured" in md and "Not drawn" in md
    assert "time to target" in (run / "results.md").read_text()


def test_plot_errors_are_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no finished runs found" in err and "Traceback" not in err
    write_run(tmp_path / "r", "none", "1gbit", 2)
    assert main(["plot", str(tmp_path / "r"), "--figures", "loss_steps,nope"]) == 2
    assert "unknown figure 'nope'" in capsys.readouterr().err


def test_crossover_interpolates_in_log_space():
    bws = [1e8, 1e9, 1e10]
    x = crossover(bws, [2.0, 1.5, 0.5], [1.0, 1.0, 1.0])
    t = math.log(1.5) / (math.log(1.5) - math.log(0.5))
    assert x == pytest.approx(10 ** (9 + t), rel=1e-9)
    assert crossover(bws, [2.0, 2.0, 2.0], [1.0, 1.0, 1.0]) is None  # pays everywhere
    assert crossover(bws, [0.5, 0.5, 0.5], [1.0, 1.0, 1.0]) is None  # never pays


def test_time_to_target_on_smoothed_training_loss(tmp_path):
    write_run(tmp_path / "r", "none", "1gbit", 2)
    run = load_runs(tmp_path / "r").runs[0]
    raw = [m["loss"] for m in run.train_rows]
    step, t = run.time_to_target(LossTarget(4.0, "loss", 0.0))  # no smoothing: first raw loss <= 4
    first = next(i for i, x in enumerate(raw) if x <= 4.0)
    assert step == first + 1 and t == pytest.approx(run.times()[first])
    assert run.time_to_target(LossTarget(0.5, "loss", 0.9)) is None  # never reached
    # smoothed: the bias-corrected EMA of the raw losses (the curve the loss figures draw)
    acc, smoothed = 0.0, []
    for i, x in enumerate(raw, 1):
        acc = 0.8 * acc + 0.2 * x
        smoothed.append(acc / (1 - 0.8**i))
    first = next(i for i, x in enumerate(smoothed) if x <= 4.0)
    assert run.time_to_target(LossTarget(4.0, "loss", 0.8))[0] == first + 1 > 1
