"""A run's thread count is one of its settings: torch's intra-op threads change how sums round, so
a run resumed on a machine whose load (or ``OMP_NUM_THREADS``) changed keeps the count it was
started with, and its steps stay bit-identical to an uninterrupted run. Trains on sim with the
suite's small corpus, as tests/test_train.py does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradzip.cli import main
from gradzip.training import runtime as runtime_mod
from gradzip.training.config import TrainConfig, load_toml
from gradzip.training.loop import train
from gradzip.training.metrics import read_metrics

TINY = ["--model", "bert-tiny", "--seq-len", "64", "--batch-size", "4", "--workers", "2", "--eval-batches", "2",
        "--eval-every", "3", "--lr", "2e-3", "--warmup", "2", "--no-progress", "--steps", "6"]
# Everything a step computes (not its timings).
SAME = ("step", "loss", "mlm_loss", "nsp_loss", "lr", "tokens", "samples", "bytes_sent", "grad_norm", "eval_loss")


def computed(out: Path) -> list[tuple]:
    return [tuple(r.get(k) for k in SAME) for r in read_metrics(out / "metrics.jsonl")]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.fixture
def args(corpus) -> list[str]:
    return [*TINY, "--corpus", str(corpus)]


def test_resume_under_another_load_keeps_the_thread_count(tmp_path, args, monkeypatch, capsys):
    """2 threads for 3 steps, then resumed where only 1 is asked for (an explicit OMP_NUM_THREADS,
    or fewer free cores): the resumed run computes on the saved 2 and matches 6 uninterrupted
    steps on 2 threads bit for bit; on 1 thread the same run computes differently."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    full = tmp_path / "full"
    assert main(["train", *args, "--out", str(full)]) == 0
    assert summary(full)["threads"] == summary(full)["threads_requested"] == 2
    assert load_toml(full / "config.toml")["threads"] == 2  # the count is part of the run's settings

    # A busier machine, told so by OMP_NUM_THREADS: a warning that names both counts.
    part = tmp_path / "part"
    assert main(["train", *args, "--stop-at", "3", "--out", str(part)]) == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    capsys.readouterr()
    assert main(["train", "--out", str(part), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "OMP_NUM_THREADS=1 differs from this run's 2 threads" in err and "torch uses 2" in err
    assert computed(part) == computed(full) and len(computed(full)) == 6
    s = summary(part)
    assert (s["threads"], s["threads_requested"], s["final_loss"]) == (2, 1, summary(full)["final_loss"])

    # A busier machine seen through its free cores (no OMP_NUM_THREADS): 2 free, then 1 free.
    monkeypatch.delenv("OMP_NUM_THREADS")
    free = {"n": 2}
    monkeypatch.setattr(runtime_mod, "busy_elsewhere", lambda: 0.0)
    monkeypatch.setattr(runtime_mod, "choose_threads", lambda busy: (free["n"], f"{free['n']} of 2 cores free"))
    cores = tmp_path / "cores"
    assert main(["train", *args, "--stop-at", "3", "--out", str(cores)]) == 0
    assert summary(cores)["threads"] == 2
    free["n"] = 1
    capsys.readouterr()
    # Resumed as a sweep resumes a cell, from Python with the settings but no thread count.
    settings = {k: v for k, v in load_toml(cores / "config.toml").items() if k != "threads"}
    assert train(TrainConfig.from_dict({**settings, "resume": True}))["threads"] == 2
    assert "warning: OMP_NUM_THREADS" not in capsys.readouterr().err  # nothing explicit was overridden
    assert computed(cores) == computed(full)
    assert (summary(cores)["threads"], summary(cores)["threads_requested"]) == (2, 1)

    # The test has teeth: the same 6 steps on 1 thread do not give the same numbers.
    one = tmp_path / "one"
    assert main(["train", *args, "--out", str(one)]) == 0
    assert summary(one)["threads"] == 1 and computed(one) != computed(full)


def test_an_explicit_other_thread_count_on_resume_is_refused(tmp_path, args, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = tmp_path / "run"
    assert main(["train", *args, "--steps", "2", "--out", str(run)]) == 0
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--steps", "4", "--threads", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--threads 2 vs 1" in err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_an_unset_count_is_no_difference():
    """Sweeps and Python callers resume with ``threads`` unset: the run's saved count applies."""
    assert TrainConfig().diff(TrainConfig(threads=2)) == [] == TrainConfig(threads=2).diff(TrainConfig())
    assert TrainConfig(threads=1).diff(TrainConfig(threads=2)) == ["--threads 1 vs 2"]
    with pytest.raises(Exception, match="threads must be >= 1"):
        TrainConfig.from_dict({"threads": 0})
