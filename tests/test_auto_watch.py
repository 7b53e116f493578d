"""When the auto policy plans again (gradzip.auto.watch.PolicyWatch), with given timings: the first
plan, drift against max(tolerance x step, noise x link time), patience, the periodic re-plan, the
codec timings kept for a link-only re-plan, and the state a checkpoint carries; then the engine
(gradzip.engine.auto.AutoEngine on sim) acting on it: a drift re-plan probes the link only, and
every plan's bytes are counted in the step it follows."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from gradzip.auto import measure
from gradzip.auto.watch import PolicyWatch, Replan
from gradzip.cluster.auto import AutoPlan
from gradzip.cluster.network import CodecCost
from gradzip.comm.cost import allreduce_bytes
from gradzip.comm.sim import SimWorld
from gradzip.engine.auto import AutoEngine
from gradzip.engine.config import EngineConfig
from gradzip.plan.auto import parse_auto

PLAN = AutoPlan(["fp16"], step_s=1.0, comm_s=0.2, link_s=0.5, compute_s=0.8)
CODECS = {"none": CodecCost(), "fp16": CodecCost(1e-9, 0.0, "measured")}


class Agree:
    """The ranks' mean of the gap: here the gap itself, with the calls counted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gap: float) -> float:
        self.calls += 1
        return gap


def planned(spec: str, noise: float = 0.0, min_steps: int = 0) -> PolicyWatch:
    """A watch that made its first plan (``PLAN``) at step 1."""
    w = PolicyWatch(parse_auto(spec), min_steps)
    w.step()
    first = w.check(0.0, Agree())
    assert first == Replan("first plan")
    w.planned(first.reason, PLAN, noise, ("bucket sizes",), CODECS)
    return w


@pytest.mark.parametrize(("spec", "min_steps", "first_at", "reason"), [
    ("auto", 0, 1, "first plan"),
    ("auto:warmup=2", 0, 2, "after 2 warm-up steps"),
    ("auto:warmup=1", 2, 2, "first plan"),  # the DDP hook: its buckets are rebuilt after step 1
    ("auto:warmup=3", 2, 3, "after 3 warm-up steps"),
])
def test_the_first_plan_waits_for_warmup_and_agrees_nothing(spec, min_steps, first_at, reason):
    w, agree = PolicyWatch(parse_auto(spec), min_steps), Agree()
    decisions = []
    for _ in range(first_at):
        w.step()
        decisions.append(w.check(5.0, agree))
    assert decisions == [None] * (first_at - 1) + [Replan(reason)] and agree.calls == 0


def test_on_a_quiet_host_tolerance_and_patience_decide():
    """noise 0: a gap over 10% of the 1 s step is drift; 3 in a row re-plan the link only; a step
    back on the prediction resets the count."""
    w, agree = planned("auto:replan_every=0"), Agree()
    comm = [0.35, 0.35, 0.25, 0.35, 0.35, 0.35]  # predicted 0.2: gaps 0.15, 0.15, 0.05, 0.15 ...
    got = []
    for c in comm:
        w.step()
        got.append(w.check(c, agree))
    assert w.threshold() == pytest.approx(0.1) and agree.calls == len(comm)
    assert got[:5] == [None] * 5
    assert got[5] == Replan("measured communication off the prediction for 3 steps", link_only=True)


def test_on_a_noisy_host_a_gap_within_the_noise_sends_no_probe():
    """The probe's repeats varied by 80% (noise 0.8) on a 0.5 s link: gaps up to 0.4 s are the host's,
    not the link's, whatever the tolerance says; a larger one still counts."""
    w, agree = planned("auto:replan_every=0,patience=1", noise=0.8), Agree()
    assert w.threshold() == pytest.approx(0.4)
    for c in (0.55, 0.1, 0.6, 0.0):  # gaps 0.35, 0.1, 0.4, 0.2: all within the noise
        w.step()
        assert w.check(c, agree) is None
    w.step()
    assert w.check(0.65, agree) == Replan("measured communication off the prediction for 1 steps", link_only=True)
    quiet = planned("auto:replan_every=0,patience=1", noise=0.0)
    quiet.step()
    assert quiet.check(0.55, Agree()) is not None  # the same 0.35 s gap on a quiet host: a re-plan


def test_periodic_replans_measure_everything_and_drift_keeps_the_codecs():
    w = planned("auto:replan_every=2,tolerance=100")
    w.step()
    assert w.check(9.0, Agree()) is None
    w.step()
    periodic = w.check(9.0, Agree())
    assert periodic == Replan("every 2 steps") and w.codecs(periodic, ("bucket sizes",)) is None
    drift = Replan("off", link_only=True)
    kept = w.codecs(drift, ("bucket sizes",))
    assert kept == CODECS and kept is not w.codecs(drift, ("bucket sizes",))  # a copy each time
    assert w.codecs(drift, ("other buckets",)) is None  # timed on other buckets: time them again


def test_the_state_round_trips_but_not_the_codecs():
    w = planned("auto:replan_every=0", noise=0.3)
    w.step()
    w.check(5.0, Agree())
    w.probe_bytes = 1234
    other = PolicyWatch(parse_auto("auto:replan_every=0"))
    other.load_state_dict(json.loads(json.dumps(w.state_dict())))
    assert (other.steps, other.planned_at, other.drift, other.probe_bytes) == (2, 1, 1, 1234)
    assert other.prediction == w.prediction and other.plans == w.plans and other.threshold() == w.threshold()
    assert other.codecs(Replan("off", link_only=True), ("bucket sizes",)) is None


def sim_run(tmp_path, monkeypatch, steps: int, drift_from: int | None = None):
    """AutoEngine on 4 sim workers (100 Mbit/s) over a linear model, with patience 1; from step
    ``drift_from`` on, the prediction is pushed far from what sim measures (a changed link). Returns
    the engine, its policy.jsonl lines, each step's (bytes_sent, probe_bytes) and the codec timings' count."""
    timed, sent = [], []

    def fake_time_codecs(candidates, sizes, device="cpu", now=None):
        timed.append(1)
        return {c: CodecCost(0.0 if c == "none" else 1e-9, 0.0, "given") for c in candidates}

    monkeypatch.setattr("gradzip.engine.auto.time_codecs", fake_time_codecs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 32, bias=False))
    eng = AutoEngine(model, "auto:candidates=none/fp16,patience=1,replan_every=0", SimWorld(4, "100mbit"),
                     EngineConfig(min_compress_numel=16), log=tmp_path / "policy.jsonl")

    class Step:
        def step(self, clip: bool = True) -> float:
            return 0.0

        def skip(self) -> None:
            pass

    for s in range(steps):
        for w in eng.worker_ids:
            with eng.worker(w):
                model(torch.randn(2, 64)).sum().backward()
        stats = eng.synchronize()
        if drift_from is not None and s + 1 >= drift_from:
            eng.watch.prediction["comm_s"] = 1e3
        eng.commit(0, Step())
        sent.append((stats.bytes_sent, stats.probe_bytes))
    log = [json.loads(x) for x in (tmp_path / "policy.jsonl").read_text().splitlines()]
    return eng, log, sent, len(timed)


def test_a_drift_replan_probes_the_link_and_keeps_the_codecs(tmp_path, monkeypatch):
    _, log, _, timed = sim_run(tmp_path, monkeypatch, 3, drift_from=2)
    assert [(r["step"], r["codecs_reused"]) for r in log] == [(1, False), (2, True), (3, True)]
    assert "off the prediction" in log[1]["reason"] and timed == 1  # the codecs were timed once
    assert all(r["noise"] == 0 for r in log)  # sim's probe is the model: no noise


def test_sim_counts_the_probe_a_real_link_would_take(tmp_path, monkeypatch):
    """Every byte of the policy is in the step it follows: the first plan's probe (64 KiB and 1 MiB
    at 100 Mbit/s, 3 ring allreduces each, an 8-byte mean after each) and its 4 figures' mean, then
    an 8-byte gap after every later step."""
    eng, log, sent, _ = sim_run(tmp_path, monkeypatch, 3)
    probe = 3 * (allreduce_bytes(64 << 10, 4) + allreduce_bytes(1 << 20, 4)) + 2 * allreduce_bytes(8, 4)
    assert measure.modelled_probe_bytes(4, 50e-6, 100e6) == probe
    plan = probe + allreduce_bytes(6 * 8, 4)  # latency, 1/bandwidth, compute, optimizer, noise, fp16's cost
    assert log[0]["probe_bytes"] == plan
    total, probes = zip(*sent)
    assert probes == (plan, allreduce_bytes(8, 4), allreduce_bytes(8, 4))
    assert total[1] - probes[1] == total[2] - probes[2]  # the same exchange, and the same gap's bytes on top
    assert total[0] - probes[0] > total[1] - probes[1]  # step 1 went uncompressed
    assert eng.summary()["auto_probe_bytes"] == sum(probes)


def test_a_fast_link_is_probed_with_8_mib_too():
    n, fast = 4, 10e9  # 1 MiB takes under 20 ms: the probe goes on to 8 MiB
    sizes = (64 << 10, 1 << 20, 8 << 20)
    assert measure.modelled_probe_bytes(n, 5e-6, fast) == sum(3 * allreduce_bytes(s, n) + allreduce_bytes(8, n)
                                                              for s in sizes)
    assert measure.modelled_probe_bytes(1, 5e-6, fast) == 0
