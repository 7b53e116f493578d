"""The prepared GPU run (``python -m gradzip.bench.gpu_run``) and what it relies on, tested on the CPU
piece by piece (its whole ``--cpu`` version takes about 3 minutes on 2 cores, too long for the suite):
the spec overrides, the step-count calibration, the issue's targets, the time limits of a step, the
``--device``/``--precision`` flags of ``gradzip bench train``, the ``torch.topk`` baseline of
``gradzip bench compress``, and the ``gpu-evidence`` spec."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from gradzip.bench import gpu_run
from gradzip.cli import main
from gradzip.experiments.run_cli import load_shipped
from gradzip.experiments.spec import parse_spec


def test_override_replaces_and_adds_base_keys_only():
    text = gpu_run.SPEC.read_text(encoding="utf-8")
    new = gpu_run.override(text, {"steps": 128, "device": "cpu", "corpus": "/tmp/c.txt"})
    data = tomllib.loads(new)
    assert data["base"]["steps"] == 128 and data["base"]["device"] == "cpu" and data["base"]["corpus"] == "/tmp/c.txt"
    assert data["grid"] == tomllib.loads(text)["grid"] and data["plot"] == tomllib.loads(text)["plot"]
    parse_spec(data, Path("gpu-evidence.toml"))  # still a valid spec
    with pytest.raises(ValueError, match=r"no \[base\]"):
        gpu_run.override("name = 'x'\n", {"steps": 1})


def test_scaled_steps_fit_the_time_and_round_to_the_diloco_period():
    # 5 cells at 0.1 s per step: 0.575 s per step of all cells with the evaluation overhead
    assert gpu_run.scaled_steps([0.1] * 5, fixed_s=50, available_s=400, cap=1024) == 576
    assert gpu_run.scaled_steps([0.1] * 5, fixed_s=50, available_s=40, cap=1024) == 64  # at least one period
    assert gpu_run.scaled_steps([0.001] * 5, fixed_s=0, available_s=400, cap=1024) == 1024  # at most the cap
    assert gpu_run.scaled_steps([0.01], fixed_s=0, available_s=0.05, cap=32, multiple=8) == 8


def test_step_seconds_is_the_median_after_warm_up(tmp_path):
    host = [5.0, 5.5, 5.6, 5.7, 5.8, 6.8, 6.9]  # warm-up, then 0.1 s steps and one slow one
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i + 1, "host_s": h}) + "\n" for i, h in enumerate(host))
                       + json.dumps({"step": 7, "eval_loss": 7.0}) + "\n")
    assert gpu_run.step_seconds(metrics, skip=2) == pytest.approx(0.1)
    assert gpu_run.step_seconds(tmp_path / "none.jsonl") is None


def test_target_rows_judge_the_issue_targets():
    rows = [{"name": "fp16", "spec": "fp16", "ratio_to_memcpy": 1.5},
            {"name": "topk", "spec": "topk:ratio=0.01", "ratio_to_memcpy": 1.0},  # bare: not the EF target
            {"name": "topk", "spec": "topk:ratio=0.01,ef=true", "ratio_to_memcpy": 12.0, "ratio_to_torch_topk": 3.0},
            {"name": "powersgd", "spec": "powersgd:rank=4,ef=true", "ratio_to_matmul": 1.2},
            {"name": "onebit", "spec": "onebit:ef=true", "error": "RuntimeError: x"}]
    got = {t["target"]: t for t in gpu_run.target_rows(rows)}
    assert list(got) == [t[0] for t in gpu_run.ISSUE_TARGETS]
    assert got["fp16"]["meets"] is True and got["bf16"]["meets"] is None and got["bf16"]["error"] == "no row"
    assert got["top-k 1% + EF"]["meets"] is False and got["top-k 1% + EF"]["ratio_to_torch_topk"] == 3.0
    assert got["PowerSGD rank 4 + EF"]["meets"] is True and got["PowerSGD rank 4 + EF"]["reference"] == "matmul"
    assert got["1-bit + EF"]["meets"] is None and "RuntimeError" in got["1-bit + EF"]["error"]


def test_a_step_over_its_limit_is_killed_and_the_next_one_runs(tmp_path):
    (tmp_path / "out").mkdir()
    r = gpu_run.Runner(tmp_path / "out", tmp_path, budget=60, env={})
    slow = r.step("slow", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], limit=6)
    assert slow["status"] == "timed out" and slow["seconds"] < 20 and slow["detail"] == "started"
    fast = r.step("fast", [sys.executable, "-c", "print('[1]')"], limit=30, stdout_to=tmp_path / "fast.json")
    assert fast["status"] == "ok" and json.loads((tmp_path / "fast.json").read_text()) == [1]
    bad = r.step("bad", [sys.executable, "-c", "raise SystemExit('broken')"], limit=30)
    assert bad["status"] == "failed" and bad["rc"] == 1 and bad["detail"] == "broken"
    r.deadline = 0  # the budget is spent: the rest is skipped, not started
    assert r.step("late", [sys.executable, "-c", "pass"], limit=30)["status"] == "skipped"
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())["steps"]
    assert list(saved) == ["slow", "fast", "bad", "late"]
    assert "[slow] started" in (tmp_path / "out" / "gpu_run.log").read_text()


def test_gpu_run_without_a_gpu_says_so(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert gpu_run.main([str(tmp_path / "out")]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
    assert gpu_run.main([str(tmp_path / "out"), "--cpu", "--only", "nope"]) == 2


def test_bench_train_device_model_and_precision_flags(capsys, corpus):
    argv = ["bench", "train", "--device", "cpu", "--model", "bert-tiny", "--steps", "2", "--skip", "1",
            "--batch-size", "2", "--seq-len", "16", "--loss-steps", "0", "--corpus", str(corpus), "--json"]
    assert main([*argv, "--precision", "fp32,bf16"]) == 0
    rows = json.loads(capsys.readouterr().out)["throughput"]
    assert [(r["model"], r["precision"], r["device"]) for r in rows] == [("bert-tiny", "fp32", "cpu"),
                                                                          ("bert-tiny", "bf16", "cpu")]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert main([*argv, "--precision", "fp8"]) == 2
    assert "--precision: unknown fp8" in capsys.readouterr().err


def test_bench_compress_times_topk_against_torch_topk(capsys):
    assert main(["bench", "compress", "--numel", "4096", "--repeat", "1", "--json", "--only", "topk:ratio=0.01,ef=true",
                 "fp16"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    topk = rows["topk"]
    assert topk["torch_topk_s"] > 0
    assert topk["ratio_to_torch_topk"] == pytest.approx(topk["time_s"] / topk["torch_topk_s"])
    assert "torch_topk_s" not in rows["fp16"]


def test_gpu_evidence_spec_cells_and_figures():
    spec = load_shipped("gpu-evidence")
    assert (spec.base["device"], spec.base["backend"], spec.base["workers"]) == ("cuda", "sim", 4)
    assert "corpus" not in spec.base and spec.base["steps"] % gpu_run.DILOCO_H == 0
    assert [(c.config.get("compressor"), c.config.get("sync", "step")) for c in spec.cells] == [
        ("none", "step"), ("onebit:ef=true", "step"), ("topk:ratio=0.01,ef=true", "step"),
        ("powersgd:rank=4", "step"), ("int8bins", "diloco:every=64")]
    assert tuple(spec.plot.figures or ()) == gpu_run.FIGURES
    assert "calibrat" in gpu_run.SPEC.read_text(encoding="utf-8")  # the step count is flagged as unconfirmed


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gpu_run_evidence_piece_on_the_cpu(tmp_path, corpus, capsys):
    """The --cpu version of step 5 (calibration, the scaled sweep, the figures) and what OUT then
    holds: at most 8 files, as a device session brings back, the three figures among them."""
    out = tmp_path / "out"
    code = gpu_run.main([str(out), "--cpu", "--only", "evidence", "--corpus", str(corpus), "--budget", "90",
                         "--calibrate-steps", "4", "--work", str(tmp_path / "work")])
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0, printed
    assert [k for k, v in summary["steps"].items() if v["status"] == "ok"] == ["evidence-calibrate", "evidence"]
    ev = summary["evidence"]
    assert ev["steps"] % 8 == 0 and ev["why"].startswith("calibrated: 5 cells")
    assert len(ev["cells"]) == 5 and all(c["steps"] == ev["steps"] for c in ev["cells"].values())
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {f"{f}.png" for f in gpu_run.FIGURES} <= set(files)
    assert {"summary.md", "summary.json", "gpu_run.log", "gpu_run.tar.gz"} <= set(files)
    assert "## gpu-evidence" in (out / "summary.md").read_text()


def test_prepare_builds_the_data_of_each_model_and_length(capsys, corpus):
    assert gpu_run.main(["-", "--prepare", "bert-tiny:32,bert-tiny:16", "--corpus", str(corpus)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["bert-tiny, 32 tokens", "bert-tiny, 16 tokens"]
