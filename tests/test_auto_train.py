"""``gradzip train --compressor auto`` (gradzip.engine.auto.AutoEngine) on the sim backend: the first
plan from the measured link, re-plans, policy.jsonl, warm-up, the summary, resume and bad input."""

from __future__ import annotations

import json

import pytest

from gradzip.cli import main
from gradzip.comm.cost import allreduce_bytes
from gradzip.training.metrics import read_metrics

TINY = ["--model", "bert-tiny", "--seq-len", "32", "--batch-size", "4", "--workers", "4", "--eval-batches", "1",
        "--eval-every", "0", "--no-progress", "--checkpoint-every", "0"]


def train(tmp_path, corpus, name: str, *args: str) -> tuple[list[dict], list[dict], dict]:
    out = tmp_path / name
    assert main(["train", *TINY, "--corpus", str(corpus), *args, "--out", str(out)]) == 0
    policy = [json.loads(x) for x in (out / "policy.jsonl").read_text().splitlines()]
    return read_metrics(out / "metrics.jsonl"), policy, json.loads((out / "summary.json").read_text())


def test_a_slow_link_is_planned_compressed_and_replanned(tmp_path, corpus):
    metrics, policy, summary = train(tmp_path, corpus, "slow", "--bandwidth", "100mbit", "--steps", "4",
                                     "--compressor", "auto:replan_every=2")
    assert [p["step"] for p in policy] == [1, 3] and policy[0]["reason"] == "first plan"
    assert policy[0]["bandwidth_bps"] == 100e6 and policy[0]["latency_s"] == pytest.approx(50e-6)
    chosen = {b["candidate"] for b in policy[0]["buckets"]}
    assert chosen - {"none"} and not policy[0]["none_is_best"]
    assert policy[0]["predicted_step_s"] <= min(policy[0]["fixed_step_s"].values()) * 1.001
    assert policy[0]["opt_s"] == 0  # sim's modelled step leaves the optimizer out
    # step 1 ran every bucket uncompressed (the initial choice); after the plan, far fewer bytes
    assert metrics[1]["bytes_sent"] < metrics[0]["bytes_sent"] / 3
    assert summary["auto_plans"] == 2 and summary["exchange"] == "per bucket" and not summary["auto_none_is_best"]
    assert sum(summary["auto_choice"].values()) == len(policy[0]["buckets"])
    # gradzip plot draws the decisions over the run on the measured link, and the rate a trace set
    # (link.jsonl, as gradzip train --netem-trace writes it: here made up)
    (tmp_path / "slow" / "link.jsonl").write_text('{"t": 0, "step": 0, "rate_bps": 1e8}\n'
                                                  '{"t": 1, "step": 2, "rate_bps": 1e9}\n')
    assert main(["plot", str(tmp_path / "slow"), "--figures", "policy"]) == 0
    png = tmp_path / "slow" / "figures" / "policy.png"
    assert png.stat().st_size > 10_000
    assert "policy.jsonl" in (tmp_path / "slow" / "figures" / "figures.md").read_text()
    assert "the rate the testbed's trace set (link.jsonl)" in (tmp_path / "slow" / "figures" / "figures.md").read_text()


def test_a_free_link_says_none_is_best(tmp_path, corpus):
    _, policy, summary = train(tmp_path, corpus, "free", "--bandwidth", "100000gbit", "--latency", "0us",
                               "--steps", "2", "--compressor", "auto")
    assert policy[0]["none_is_best"] and {b["candidate"] for b in policy[0]["buckets"]} == {"none"}
    assert summary["auto_none_is_best"] and "no candidate was predicted faster than none" in summary["auto_note"]


def test_warmup_then_plan_and_resume_keeps_the_plan(tmp_path, corpus):
    args = ["--bandwidth", "100mbit", "--steps", "4", "--compressor", "auto:warmup=2,replan_every=0",
            "--checkpoint-every", "2"]
    metrics, policy, summary = train(tmp_path, corpus, "full", *args)
    assert [p["step"] for p in policy] == [2] and "after 2 warm-up steps" in policy[0]["reason"]
    # The plan's traffic is a part of step 2's bytes: the probe a real link would take (at 100 Mbit/s
    # it stops after 64 KiB and 1 MiB, 3 ring allreduces of each over 4 ranks, and an 8-byte mean
    # after each size) and the mean of the plan's 9 figures; then an 8-byte gap after steps 3 and 4.
    probe = 3 * (allreduce_bytes(64 << 10, 4) + allreduce_bytes(1 << 20, 4)) + 2 * allreduce_bytes(8, 4)
    assert policy[0]["probe_bytes"] == probe + allreduce_bytes(9 * 8, 4) == 5_013_636
    assert metrics[1]["bytes_sent"] == metrics[0]["bytes_sent"] + policy[0]["probe_bytes"]
    assert metrics[0]["bytes_sent"] > 3 * metrics[2]["bytes_sent"]
    assert summary["auto_probe_bytes"] == policy[0]["probe_bytes"] + 2 * allreduce_bytes(8, 4)
    sent = sum(r["bytes_sent"] for r in metrics)  # the compression figure counts them
    assert summary["bytes_total"] == sent and summary["compression_ratio"] == pytest.approx(
        summary["uncompressed_bytes_per_step"] * 4 / sent)
    out = tmp_path / "cut"
    assert main(["train", *TINY, "--corpus", str(corpus), *args, "--stop-at", "2", "--out", str(out)]) == 0
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    resumed = read_metrics(out / "metrics.jsonl")
    cut = [json.loads(x) for x in (out / "policy.jsonl").read_text().splitlines()]
    assert [p["step"] for p in cut] == [2] and json.loads((out / "summary.json").read_text())["auto_plans"] == 1
    sent = [r["bytes_sent"] for r in resumed]
    assert sent[:2] == [r["bytes_sent"] for r in metrics][:2] and sent[2] == sent[3]  # the plan came back
    # The cut run planned from its own measurement: the same plan as the full run's, the same bytes.
    if [b["candidate"] for b in cut[0]["buckets"]] == [b["candidate"] for b in policy[0]["buckets"]]:
        assert sent == [r["bytes_sent"] for r in metrics]


def test_hierarchical_plans_with_both_links(tmp_path, corpus):
    """--hierarchical: the plan prices the node's link and the link between nodes (sim: the modelled
    ones), and the run compresses across nodes only."""
    metrics, policy, summary = train(tmp_path, corpus, "hier", "--bandwidth", "100mbit", "--steps", "3",
                                     "--ranks-per-node", "2", "--hierarchical", "--compressor", "auto")
    p = policy[0]
    assert p["ranks_per_node"] == 2 and p["bandwidth_bps"] == 100e6 and p["intra_bandwidth_bps"] > 100e6
    assert {b["candidate"] for b in p["buckets"]} - {"none"} and summary["auto_plans"] == 1
    assert metrics[1]["bytes_inter"] < metrics[0]["bytes_inter"] / 3


@pytest.mark.parametrize(("args", "words"), [
    (["--compressor", "auto:floor=nosuch"], "--compressor: auto: candidate 'nosuch'"),
    (["--compressor", "auto", "--sync", "diloco:every=4"], "does not combine with --sync diloco:every=4"),
    (["--compressor", "auto", "--exchange", "allgather"], "does not combine with --exchange"),
])
def test_bad_auto_is_one_line(tmp_path, capsys, args, words):
    assert main(["train", *TINY, *args, "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and not (tmp_path / "bad").exists()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ranks_that_measure_differently_still_replan_together(tmp_path, corpus):
    """A straggler (rank 1 sleeps before steps 3 and 4) makes rank 0 wait in the exchange while rank 1
    does not: the drift each rank sees differs, and a re-plan is collective. The ranks decide on their
    mean, so they re-plan together and the run ends cleanly."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "GRADZIP_FAULT")}
    env.update(OMP_NUM_THREADS="1", GRADZIP_FAULT="delay:step=3-4,rank=1,seconds=1")
    out = tmp_path / "gloo"
    proc = subprocess.run([sys.executable, "-m", "gradzip", "train", *TINY, "--workers", "2", "--backend", "gloo",
                           "--corpus", str(corpus), "--steps", "7", "--compressor",
                           "auto:patience=1,tolerance=0.5,replan_every=0", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plans = [json.loads(x) for x in (out / "policy.jsonl").read_text().splitlines()]
    assert plans[0]["step"] == 1 and any("off the prediction" in p["reason"] for p in plans[1:]), plans
    assert len(read_metrics(out / "metrics.jsonl")) == 7
    # the measured optimizer step is in the predicted step times (it is in metrics' step_s), alike for all
    p = plans[0]
    assert p["opt_s"] > 0 and p["predicted_step_s"] >= min(p["fixed_step_s"].values()) * 0.999
    assert all(t > p["opt_s"] for t in p["fixed_step_s"].values())


def test_resume_drops_the_plans_made_after_the_checkpoint(tmp_path, corpus):
    """A run that planned after its last checkpoint and then died: resuming drops those plans from
    policy.jsonl (as metrics.jsonl loses the steps after the checkpoint), and the log then holds each
    plan once."""
    out = tmp_path / "run"
    args = ["--bandwidth", "100mbit", "--steps", "4", "--compressor", "auto:replan_every=2", "--checkpoint-every", "2"]
    assert main(["train", *TINY, "--corpus", str(corpus), *args, "--out", str(out)]) == 0
    full = [json.loads(x)["step"] for x in (out / "policy.jsonl").read_text().splitlines()]
    assert full == [1, 3]
    for p in out.glob("ckpt-00000004*"):  # as if the run had died after planning at step 3
        p.unlink()
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert [json.loads(x)["step"] for x in (out / "policy.jsonl").read_text().splitlines()] == [1, 3]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_hierarchical_on_gloo_probes_both_groups(tmp_path, corpus):
    """4 gloo ranks, 2 per emulated node: the node leaders probe the link between nodes, every node
    its own link, and all ranks plan alike from the means."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "GRADZIP_FAULT")}
    env.update(OMP_NUM_THREADS="1")
    out = tmp_path / "hier"
    proc = subprocess.run([sys.executable, "-m", "gradzip", "train", *TINY, "--workers", "4", "--ranks-per-node", "2",
                           "--hierarchical", "--backend", "gloo", "--corpus", str(corpus), "--steps", "3",
                           "--compressor", "auto:replan_every=2", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plans = [json.loads(x) for x in (out / "policy.jsonl").read_text().splitlines()]
    assert [p["step"] for p in plans] == [1, 3] and all(p["ranks_per_node"] == 2 for p in plans)
    assert all(p["bandwidth_bps"] > 0 and p["intra_bandwidth_bps"] > 0 and p["probe_bytes"] > 0 for p in plans)
