"""Overlapped outer updates (``--sync diloco|localsgd|sparseloco:...,overlap=1``,
:mod:`gradzip.engine.diloco`): the delayed rule against a hand computation, exact to the bit;
overlap=0 unchanged; sim's clock and ``gradzip simulate`` charging max(compute, exchange) per round
instead of the sum; resume with an exchange in flight; the spellings and their one-line errors."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import gradzip
import gradzip.cluster.simulate as sim
import gradzip.engine.sparseloco  # noqa: F401  (registers --sync sparseloco)
from gradzip.cli import main
from gradzip.comm.sim import SimWorld
from gradzip.errors import SpecError
from gradzip.plan.sync import parse_sync
from gradzip.training.metrics import read_metrics

H, ROUNDS = 2, 4
IN_LR, OUT_LR, MU = 0.25, 0.5, 0.5  # powers of two: every float below is exact


def _grad(w: int, t: int) -> torch.Tensor:
    return torch.full((4, 4), (w + 1) * t / 4)


def _train(overlap: int) -> list[torch.Tensor]:
    """Two sim workers, worker w's gradient (w+1)·t/4 at step t; the model (worker 0) after each sync."""
    m = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.arange(16.0).reshape(4, 4) / 8)
    inner = torch.optim.SGD(m.parameters(), lr=IN_LR)
    outer = torch.optim.SGD(m.parameters(), lr=OUT_LR, momentum=MU, nesterov=True)
    d = gradzip.DiLoCo(m, inner, outer, SimWorld(2), H, outer_overlap=overlap)
    seen = []
    for t in range(1, H * ROUNDS + 1):
        for w in d.worker_ids:
            with d.worker(w):
                m.weight.grad = _grad(w, t)
                inner.step()
        if t % H == 0:
            seen.append(m.weight.detach().clone())
    return seen


def _by_hand(overlap: int) -> list[torch.Tensor]:
    """Round k: every worker starts from θ_g and takes H SGD steps; Δ_k = mean_w(θ_g − θ_w). No
    overlap: θ_g ← Nesterov(θ_g, Δ_k). Overlap: θ_g ← Nesterov(θ_g, Δ_{k−1}) (nothing at round 1),
    Δ_k waits a round."""
    theta = torch.arange(16.0).reshape(4, 4) / 8
    buf: torch.Tensor | None = None
    pending: torch.Tensor | None = None
    out = []
    for k in range(1, ROUNDS + 1):
        steps = range((k - 1) * H + 1, k * H + 1)
        local = [theta - sum(IN_LR * _grad(w, t) for t in steps) for w in (0, 1)]
        delta = (theta - local[0] + (theta - local[1])) / 2
        g, pending = (pending, delta) if overlap else (delta, None)
        if g is not None:
            buf = g.clone() if buf is None else MU * buf + g
            theta = theta - OUT_LR * (g + MU * buf)
        out.append(theta)
    return out


@pytest.mark.parametrize("overlap", [0, 1])
def test_each_round_equals_the_delayed_rule_by_hand(overlap):
    got, want = _train(overlap), _by_hand(overlap)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if overlap:
        assert torch.equal(got[0], want[0]) and not torch.equal(got[1], _by_hand(0)[1])


def test_overlap_0_is_todays_diloco():
    assert str(parse_sync("diloco:every=4,overlap=0")) == "diloco:every=4,outer_lr=0.7,momentum=0.9,fragments=1,delay=0"
    assert str(parse_sync("localsgd:every=4,overlap=1")) == "localsgd:every=4,overlap=1"
    s = parse_sync("diloco:every=4,overlap=1")
    assert s.overlap == 1 and parse_sync(str(s)) == s
    sl = parse_sync("sparseloco")
    assert "overlap" not in str(sl) and parse_sync("sparseloco:overlap=1").overlap == 1


@pytest.mark.parametrize("text, why", [
    ("step:overlap=1", "--sync step has no outer step to overlap"),
    ("diloco:every=4,overlap=2", "overlap=2 must be 0 or 1"),
    ("diloco:every=4,fragments=2,delay=1,overlap=1", "give delay=0 with it")])
def test_bad_overlap_is_a_one_line_error(text, why):
    with pytest.raises(SpecError, match=why) as e:
        parse_sync(text)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------- time: sim's clock, simulate
def _clock(overlap: int, compute: float, fragments: int = 1, rounds: int = 4) -> list:
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(48, 48, bias=False) for _ in range(4)])
    d = gradzip.DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.01), torch.optim.SGD(m.parameters(), lr=1.0),
                       SimWorld(2, "10mbit", "1ms"), 4, fragments=fragments, bucket_cap_mb=0.005,
                       outer_overlap=overlap, hook=False)
    return [d.after_inner_step(compute_s=compute) for _ in range(4 * rounds)]


@pytest.mark.parametrize("compute", [2.0 ** -10, 2.0 ** -5], ids=["link-bound", "compute-bound"])
def test_sim_round_takes_max_of_compute_and_exchange_with_overlap_and_the_sum_without(compute):
    plain, over = _clock(0, compute), _clock(1, compute)
    link = plain[3].link_s  # one exchange of the whole model
    assert link > 0 and all(s.link_s == link for s in plain[3::4])
    assert [s.exposed_s for s in plain[3::4]] == [link] * 4  # round = 4·compute + link
    # overlap: the first sync only sends; each later one applies the last round's exchange, which
    # travelled during the 4 inner steps since: it waits max(0, link − 4·compute) (compute ≤ 2⁻⁵: exact sums)
    assert [(s.sent, s.applied) for s in over[3::4]] == [(1, 0), (1, 1), (1, 1), (1, 1)]
    assert [s.link_s for s in over[3::4]] == [0.0, link, link, link]
    assert [s.exposed_s for s in over[3::4]] == [0.0] + [max(0.0, link - 4 * compute)] * 3
    for s in over[7::4]:  # a round: 4·compute + wait = max(4·compute, link) (to the last bit where no rounding)
        assert 4 * compute + s.exposed_s == pytest.approx(max(4 * compute, link), rel=1e-15)
    assert all(s.exposed_s == 0 and s.link_s == 0 for i, s in enumerate(over) if i % 4 != 3)
    assert (link > 4 * compute) == (compute < 2.0 ** -5)  # both sides of the max are exercised


def test_sim_fragments_share_one_link_with_overlap():
    """P = 2 fragments both in flight: per period the link carries both, so a link-bound period
    takes their sum of link time, not each one's alone."""
    compute = 2.0 ** -10
    over = _clock(1, compute, fragments=2, rounds=6)
    links = [s.link_s for s in over[8:12]]
    per_period = sum(links)
    assert per_period > 4 * compute
    period = 4 * compute + sum(s.exposed_s for s in over[12:16])  # a period in steady state
    assert period == pytest.approx(per_period, rel=1e-12)
    plain = _clock(0, compute, fragments=2, rounds=6)  # each fragment's own bytes, though two are in flight
    assert [s.bytes_sent for s in over if s.applied] == [s.bytes_sent for s in plain if s.applied][:-2]
    assert all(s.bytes_sent > 0 for s in over if s.applied)


def test_simulate_predicts_max_with_overlap_and_sum_without():
    w, cl, codec = sim.Workload("bert-tiny", 1000.0, 8, 64, bucket_cap_mb=1.0), \
        sim.Cluster(4, 1, 2e7, 1e10, 50e-6, 0.0, "hierarchical", 1.0), sim.CodecCost(1e-9, 0.0)
    for h in (2, 16, 64):
        plain = sim.predict("fp16", w, cl, codec, sync=f"diloco:every={h}")
        over = sim.predict("fp16", w, cl, codec, sync=f"diloco:every={h},overlap=1")
        link, compute, codec_s = plain.comm_s * h, plain.compute_s, plain.compress_s * h
        assert over.comm_s == plain.comm_s and over.payload_bytes == plain.payload_bytes  # hidden, not removed
        assert plain.step_s * h == pytest.approx(h * compute + codec_s + link)
        assert over.step_s * h == pytest.approx(max(h * compute, link) + codec_s)
        assert over.exposed_comm_s * h == pytest.approx(max(0.0, link - h * compute))
    assert over.exposed_comm_s == 0 and plain.exposed_comm_s > 0  # H = 64 hides it all
    # P fragments travel one after another: the period's link time is their sum
    frag = sim.predict("fp16", w, cl, codec, sync="diloco:every=16,fragments=4,overlap=1")
    assert frag.exposed_comm_s * 16 == pytest.approx(max(0.0, frag.comm_s * 16 - 16 * frag.compute_s))
    assert math.isfinite(frag.step_s)


# ---------------------------------------------------------------------- gradzip train: resume
@pytest.mark.parametrize("sync", ["diloco:every=4,overlap=1", "sparseloco:every=4,k=8,overlap=1"])
def test_resume_with_an_exchange_in_flight_is_bit_identical(tmp_path, corpus, sync):
    """A stop at step 6 holds the exchange sent at step 4 in flight (finished into the checkpoint);
    the resumed run applies it at step 8 as the uninterrupted one does."""
    args = ["--model", "bert-tiny", "--seq-len", "32", "--batch-size", "4", "--workers", "2", "--eval-batches",
            "2", "--eval-every", "1", "--lr", "2e-3", "--warmup", "2", "--no-progress", "--dropout", "0",
            "--corpus", str(corpus), "--steps", "12", "--sync", sync]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["train", *args, "--out", str(full)]) == 0
    assert main(["train", *args, "--stop-at", "6", "--out", str(part)]) == 0
    assert main(["train", "--out", str(part), "--resume"]) == 0
    keys = ("step", "loss", "tokens", "bytes_sent", "bytes_recv", "grad_norm", "eval_loss", "syncs")
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    assert [tuple(r.get(k) for k in keys) for r in b] == [tuple(r.get(k) for k in keys) for r in a]
    assert [r["syncs"] for r in a if r.get("syncs")] == [1, 1]  # steps 8 and 12 apply; 4's send had none


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_gloo_equals_sim_with_overlap_and_a_resume_in_flight(tmp_path, corpus):
    """gloo's asynchronous handles carry each fragment's exchange across a round (and across a
    stop at step 6 and a resume) to the same losses, bytes and syncs as sim."""
    args = ["--model", "bert-tiny", "--seq-len", "32", "--batch-size", "4", "--workers", "2", "--eval-batches",
            "2", "--eval-every", "4", "--lr", "2e-3", "--warmup", "2", "--no-progress", "--dropout", "0",
            "--corpus", str(corpus), "--steps", "12", "--sync", "diloco:every=4,fragments=2,overlap=1",
            "--compressor", "topk:ratio=0.05,ef=true", "--bucket-cap-mb", "0.5"]
    assert main(["train", *args, "--out", str(tmp_path / "sim")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        env.pop(k, None)
    for extra in (["--stop-at", "6", *args], ["--resume"]):
        p = subprocess.run([sys.executable, "-m", "gradzip", "train", "--backend", "gloo", *extra,
                            "--out", str(tmp_path / "gloo")], env=env, capture_output=True, text=True, timeout=280)
        assert p.returncode == 0, p.stderr[-3000:]
    real, simulated = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("gloo", "sim"))
    assert [r["step"] for r in real] == list(range(1, 13)) and real[0]["clock"] == "measured"
    for a, b in zip(real, simulated, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert (a["bytes_sent"], a["syncs"], a["tokens"]) == (b["bytes_sent"], b["syncs"], b["tokens"])
    assert sum(r["syncs"] for r in real) == 4  # fragments 0 and 1 of rounds 1 and 2; round 3's in flight
