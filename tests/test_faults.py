"""Faults injected with ``GRADZIP_FAULT`` (:mod:`gradzip.training.faults`) into `gradzip train`:
a NaN/Inf gradient on one rank is skipped on every rank and training goes on; skips in a row stop
the run; a killed rank and a straggler past the timeout are named; a run that died resumes to the
uninterrupted run's numbers bit for bit. On sim, and on gloo and mpi with 2 ranks. The engine's
undoable steps themselves are covered over the whole registry in tests/test_nonfinite.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import mpi_unavailable
from test_train import TINY, computed, train_cli

from gradzip.errors import GradzipError
from gradzip.training.faults import Fault, parse_faults
from gradzip.training.metrics import read_metrics

needs_mpi = pytest.mark.skipif(mpi_unavailable() is not None, reason=str(mpi_unavailable()))
BACKENDS = [pytest.param("gloo", marks=pytest.mark.distributed),
            pytest.param("mpi", marks=[pytest.mark.distributed, needs_mpi])]


@pytest.fixture
def tiny(corpus) -> list[str]:
    return [*TINY, "--corpus", str(corpus)]


def skipped(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl") if r.get("skipped")]


def gradzip(*argv: str, fault: str | None = None, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "GRADZIP_FAULT"):
        env.pop(k, None)
    if fault:
        env["GRADZIP_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "gradzip", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)


# ---------------------------------------------------------------------- spelling
def test_fault_spellings_and_one_line_errors():
    assert parse_faults(None) == [] and parse_faults(" ; ") == []
    assert parse_faults("nan:step=3,rank=1; inf:step=5-8; delay:step=2,rank=3,seconds=1.5") == [
        Fault("nan", 3, 3, 1), Fault("inf", 5, 8, 0), Fault("delay", 2, 2, 3, 1.5)]
    assert parse_faults("KILL:rank=2,step=4") == [Fault("kill", 4, 4, 2)]
    f = Fault("raise", 2, 4, 1)
    assert [s for s in range(1, 6) if f.hits(s, 1)] == [2, 3, 4] and not f.hits(3, 0)
    for bad, why in [("boom:step=1", "unknown fault"), ("nan", "step= is required"), ("nan:step=0", ">= 1"),
                     ("nan:step=4-2", "A <= B"), ("nan:step=x", "integers"), ("nan:step=1,rank=-1", "rank"),
                     ("delay:step=1", "seconds="), ("nan:step=1,seconds=2", "applies to delay"),
                     ("nan:step=1,step=2", "twice"), ("nan:step=1,when=now", "expected step=")]:
        with pytest.raises(GradzipError, match=why) as e:
            parse_faults(bad)
        assert "\n" not in str(e.value) and "GRADZIP_FAULT" in str(e.value)


def test_a_bad_fault_spelling_stops_before_anything_is_written(tmp_path, corpus):
    p = gradzip("train", *TINY, "--corpus", str(corpus), "--steps", "2", "--out", str(tmp_path / "r"), fault="nan:3")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "GRADZIP_FAULT" in p.stderr, p.stderr
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------------- sim
def test_nan_on_one_sim_worker_is_skipped_and_a_resume_across_it_is_identical(tmp_path, tiny, monkeypatch):
    """onebit (error feedback): step 3 skipped, every loss finite, and 3 + resume + 3 steps equal
    6 steps bit for bit (the checkpoint falls right after the skipped step)."""
    monkeypatch.setenv("GRADZIP_FAULT", "nan:step=3,rank=1")
    args = [*tiny, "--compressor", "onebit", "--steps", "6"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert train_cli(*args, "--out", str(full)) == 0
    recs = read_metrics(full / "metrics.jsonl")
    assert skipped(full) == [3] and recs[2]["grad_norm"] is None
    assert all(math.isfinite(r["loss"]) for r in recs) and all(r["grad_norm"] for r in recs if r["step"] != 3)
    assert recs[-1]["loss"] < recs[0]["loss"]  # it kept training
    summary = json.loads((full / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and math.isfinite(summary["final_eval_loss"])
    assert train_cli(*args, "--stop-at", "3", "--out", str(part)) == 0
    assert train_cli("--out", str(part), "--resume") == 0
    assert computed(part) == computed(full)


def test_skips_in_a_row_stop_the_run_with_one_line(tmp_path, tiny, capsys, monkeypatch):
    monkeypatch.setenv("GRADZIP_FAULT", "inf:step=2-9,rank=1")
    out = tmp_path / "r"
    assert train_cli(*tiny, "--compressor", "topk:ratio=0.01,ef=true", "--steps", "8", "--max-skips", "3",
                     "--out", str(out)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "steps 2-4: 3 steps in a row skipped" in err, err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4] and skipped(out) == [2, 3, 4]


# ---------------------------------------------------------------------- gloo and mpi, 2 ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_on_one_rank_is_skipped_everywhere_and_resume_after_a_crash_is_identical(tmp_path, tiny, backend):
    """Rank 1's gradient of step 2 is NaN: both ranks skip it, as sim does. A second run also
    raises on rank 1 at step 4; resumed from its step-3 checkpoint it ends as the first did."""
    args = ["train", "--backend", backend, *tiny, "--compressor", "topk:ratio=0.01,ef=true", "--steps", "4",
            "--checkpoint-every", "3"]
    nan = "nan:step=2,rank=1"
    ref, crash, sim = tmp_path / "ref", tmp_path / "crash", tmp_path / "sim"
    p = gradzip(*args, "--out", str(ref), fault=nan)
    assert p.returncode == 0 and "1 step skipped" in p.stdout, p.stderr[-3000:]
    assert skipped(ref) == [2]
    p = gradzip(*args[:2], "sim", *args[3:], "--out", str(sim), fault=nan)
    assert p.returncode == 0 and skipped(sim) == [2]
    for a, b in zip(read_metrics(ref / "metrics.jsonl"), read_metrics(sim / "metrics.jsonl")):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["bytes_sent"] == b["bytes_sent"]

    p = gradzip(*args, "--out", str(crash), fault=f"{nan};raise:step=4,rank=1")
    assert p.returncode != 0 and "injected exception at step 4 on rank 1" in p.stderr
    assert [r["step"] for r in read_metrics(crash / "metrics.jsonl")] == [1, 2, 3]
    p = gradzip("train", "--out", str(crash), "--resume", fault=nan)
    assert p.returncode == 0, p.stderr[-3000:]
    assert computed(crash) == computed(ref)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_killed_rank_and_a_straggler_are_named(tmp_path, tiny, backend):
    args = ["train", "--backend", backend, *tiny, "--steps", "4", "--checkpoint-every", "0", "--timeout", "2"]
    p = gradzip(*args, "--out", str(tmp_path / "kill"), fault="kill:step=3,rank=1")
    assert p.returncode != 0
    named = "rank(s) [1]" if backend == "gloo" else "rank 1"  # mpirun names it itself
    assert named in p.stderr and ("lost" in p.stderr or "Killed" in p.stderr), p.stderr[-3000:]
    p = gradzip(*args, "--out", str(tmp_path / "slow"), fault="delay:step=2,rank=1,seconds=5")
    assert p.returncode != 0
    assert "timed out after 2 s on rank 0" in p.stderr and "rank 1" in p.stderr, p.stderr[-3000:]
