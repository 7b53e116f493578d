"""Numbers that stay true on a busy machine (:mod:`gradzip.host`, sim's CPU-time work clock): the
thread choice, contention detection, the clock ignoring time the process did not run, the thread
calibration, and what a contended run records and shows."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from gradzip import host
from gradzip.cli import main
from gradzip.comm.sim import SimWorld, set_work_scale
from gradzip.plots.results import load_runs
from gradzip.plots.table import results_markdown
from gradzip.training.metrics import read_metrics


def test_threads_respect_omp_num_threads_and_leave_busy_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert host.choose_threads(busy=5.0) == (3, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(host, "usable_cores", lambda: 4)
    assert host.choose_threads(busy=0.1) == (4, "all 4 cores free")
    assert host.choose_threads(busy=1.0) == (3, "3 of 4 cores free")
    assert host.choose_threads(busy=2.6) == (1, "1 of 4 cores free")
    assert host.choose_threads(busy=9.0)[0] == 1  # never none


def test_busy_elsewhere_sees_a_cpu_bound_neighbour():
    """A child that spins on a core is load from elsewhere; this process's own work is not."""
    import subprocess
    import sys

    quiet = host.busy_elsewhere(0.3)
    if quiet > host.usable_cores() - 1:  # every core already busy: no room left to see one more
        pytest.skip(f"the machine is saturated ({quiet:.1f} busy cores of {host.usable_cores()})")
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 5: pass"])
    try:
        time.sleep(0.3)
        busy = host.busy_elsewhere(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert busy >= quiet + 0.5, (quiet, busy)


def test_sim_work_clock_does_not_run_while_the_process_waits():
    """sim times local work in CPU time: time the process spends off a core (here, asleep) is not
    work, while computing is."""
    comm = SimWorld(2).comms[0]
    t0 = comm.work_time()
    time.sleep(0.3)
    slept = comm.work_time() - t0
    t0 = comm.work_time()
    x = 0
    while comm.work_time() - t0 < 0.05:
        x += 1
    assert slept < 0.05 and x > 0
    set_work_scale(2.0)
    try:
        t0, w0 = time.process_time(), comm.work_time()
        sum(range(2_000_000))
        assert comm.work_time() - w0 == pytest.approx((time.process_time() - t0) / 2, rel=0.05, abs=1e-3)
    finally:
        set_work_scale(1.0)
    with pytest.raises(ValueError, match=">= 1"):
        set_work_scale(0.5)


def _step(monkeypatch, own: float, busy: float, threads: int = 1) -> tuple[float, bool]:
    """One 1-second step of a HostMonitor on 2 cores in which this process used ``own`` core-seconds
    and the machine ``busy`` core-seconds (all processes)."""
    mon = host.HostMonitor(threads=threads, cores=2)
    monkeypatch.setattr(host.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(host.time, "perf_counter", lambda: 11.0)
    monkeypatch.setattr(host, "_own_cpu", lambda: 5.0 + own)
    monkeypatch.setattr(host, "_cpu_totals", lambda: (busy * 100, 200.0))  # jiffies: 100 a core-second
    mon._last = (10.0, 5.0, (0.0, 0.0))
    return mon.step([0.1])


def test_monitor_flags_a_neighbour_that_leaves_too_few_cores(monkeypatch):
    assert _step(monkeypatch, own=1.0, busy=1.0) == (0.0, False)  # only this run
    assert _step(monkeypatch, own=1.0, busy=2.0) == (1.0, False)  # a neighbour on the other, free, core
    load, contended = _step(monkeypatch, own=0.5, busy=2.0)  # half a core for us: the rest was theirs
    assert load == pytest.approx(1.5) and contended
    assert _step(monkeypatch, own=2.0, busy=2.0, threads=2) == (0.0, False)  # two threads, both cores ours
    assert _step(monkeypatch, own=1.2, busy=2.0, threads=2)[1]  # two threads, one core taken


def test_monitor_flags_compute_spread_and_summarises():
    mon = host.HostMonitor(threads=1, cores=64)
    flags = [mon.step([0.1])[1] for _ in range(6)] + [mon.step([0.2])[1]]
    assert flags[-1] is True and not any(flags[:-1])
    s = mon.summary()
    assert s["contended"] and s["contended_steps"] == 1


def test_calibration_measures_the_threads_overhead_and_leaves_the_run_alone(corpus, tmp_path):
    from gradzip.training.config import TrainConfig
    from gradzip.training.runtime import create_runtime

    cfg = TrainConfig.from_dict({"model": "bert-tiny", "workers": 2, "seq_len": 32, "batch_size": 4})
    rt = create_runtime(cfg)
    try:
        from gradzip.models import BertForPreTraining, bert_config

        torch.manual_seed(0)
        model = BertForPreTraining(bert_config("bert-tiny", vocab_size=512))
        ids = torch.randint(0, 512, (4, 32))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids),
                 "labels": ids, "next_sentence_label": torch.zeros(4, dtype=torch.long)}
        state, before = torch.get_rng_state(), [p.detach().clone() for p in model.parameters()]
        rt.threads = 2
        factor = rt.calibrate_clock(model, batch, _null)
        assert 1.0 <= factor <= 2.0 and rt.work_scale == factor and torch.get_num_threads() == 2
        assert torch.equal(torch.get_rng_state(), state)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and model.bert is not None
        assert all(p.grad is None for p in model.parameters())
        rt.threads = 1
        assert rt.calibrate_clock(model, batch, _null) == 1.0
    finally:
        rt.close()
    assert SimWorld(2).comms[0].work_time() == pytest.approx(time.process_time(), abs=0.05)  # scale reset


def _null():
    import contextlib

    return contextlib.nullcontext()


TINY = ["--model", "bert-tiny", "--seq-len", "32", "--batch-size", "4", "--workers", "2", "--steps", "4",
        "--eval-batches", "0", "--no-progress"]


def test_a_run_records_its_clock_threads_and_load(tmp_path: Path, corpus):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--corpus", str(corpus), "--out", str(out)]) == 0
    recs = read_metrics(out / "metrics.jsonl")
    assert all(isinstance(r["host_load"], float) and isinstance(r["contended"], bool) for r in recs)
    s = json.loads((out / "summary.json").read_text())
    assert s["compute_clock"] == "cpu" and s["threads"] >= 1 and s["threads_reason"] and s["work_scale"] >= 1.0
    assert {"host_load", "host_load_max", "contended_steps", "contended"} <= set(s)


def test_a_contended_run_warns_and_is_marked_in_the_table(tmp_path: Path, corpus, monkeypatch, capsys):
    monkeypatch.setattr(host.HostMonitor, "step", lambda self, c: (1.7, True))
    out = tmp_path / "sweep" / "busy"
    assert main(["train", *TINY, "--corpus", str(corpus), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "warning: 4 of 4 steps shared their cores" in line]
    assert len(warning) == 1 and "host load up to 1.7 cores" in warning[0]
    s = json.loads((out / "summary.json").read_text())
    assert s["contended"] and s["contended_steps"] == 4 and "shared their cores" in s["warning"]
    table = results_markdown(load_runs(out.parent))
    assert "modelled (contended)" in table and "(contended): some of that row's steps" in table


def test_train_leaves_torch_threads_as_it_found_them(tmp_path: Path, corpus, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the run's choice differs from the process's setting below
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["train", *TINY, "--corpus", str(corpus), "--out", str(tmp_path / "r")]) == 0
        assert json.loads((tmp_path / "r" / "summary.json").read_text())["threads"] == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
