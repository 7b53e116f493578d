"""The step schedule (cluster.schedule spans): what the sim clock models, what real backends
measure, what ``gradzip train`` writes to schedule.json and what ``gradzip plot`` draws from it."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_engine import Net, data, loss_of, run_ranks, run_step
from test_plots import assert_image

from gradzip.cli import main
from gradzip.cluster.schedule import BucketTiming, Span, model_step
from gradzip.comm.sim import SimWorld
from gradzip.engine import attach


def lane(spans: list[Span], name: str) -> list[Span]:
    return sorted((s for s in spans if s.lane == name), key=lambda s: s.start)


def total(spans: list[Span], kind: str) -> float:
    return sum(s.end - s.start for s in spans if s.kind == kind)


def test_spans_of_a_controlled_case():
    # compute 10; bucket 0 ready at 4, encode 1, link [5, 8]; bucket 1 ready at 7 (+1), encode [8, 9],
    # link [9, 12]; backward ends at 12; decodes of 0.5 each (see test_engine's arithmetic case).
    m = model_step(10.0, [BucketTiming(4, 1, [3], [], 0.5), BucketTiming(7, 1, [3], [], 0.5)])
    got = [(s.kind, s.bucket, s.start, s.end) for s in lane(m.spans, "compute")]
    assert got == [("backward", None, 0, 4), ("encode", 0, 4, 5), ("backward", None, 5, 8), ("encode", 1, 8, 9),
                   ("backward", None, 9, 12), ("decode", 0, 12, 12.5), ("decode", 1, 12.5, 13)]
    assert [(s.bucket, s.start, s.end) for s in lane(m.spans, "link")] == [(0, 5, 8), (1, 9, 12)]
    # A slow link: the waits are the exposed communication.
    m = model_step(10.0, [BucketTiming(4, 1, [20], [], 0.5), BucketTiming(7, 1, [20], [], 0.5)])
    waits = [(s.bucket, s.start, s.end) for s in m.spans if s.kind == "wait"]
    assert waits == [(0, 12, 25), (1, 25.5, 45)] and total(m.spans, "wait") == pytest.approx(m.comm_s)
    # Two rounds: the work between them, then round 1 on the link.
    m = model_step(10.0, [BucketTiming(4, 1, [3, 4], [2], 1)])
    assert [(s.kind, s.start, s.end) for s in lane(m.spans, "compute")][-3:] == [
        ("between", 11, 13), ("wait", 13, 17), ("decode", 17, 18)]
    assert [(s.round, s.start, s.end) for s in lane(m.spans, "link")] == [(0, 5, 8), (1, 13, 17)]


@st.composite
def bucket(draw) -> BucketTiming:
    rounds = draw(st.lists(st.floats(0, 20), min_size=1, max_size=3))
    return BucketTiming(ready_s=draw(st.floats(0, 1)),  # a fraction of compute, below
                        compress_s=draw(st.floats(0, 2)), rounds_s=rounds,
                        between_s=draw(st.lists(st.floats(0, 2), min_size=len(rounds) - 1, max_size=len(rounds) - 1)),
                        decode_s=draw(st.floats(0, 2)))


buckets = st.lists(bucket(), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(compute=st.floats(0, 10), bs=buckets)
# a tiny encode before a long one: the long one's start must not round back onto the tiny one
@example(compute=8.633502199094708e-235, bs=[BucketTiming(1.0, 2.3482662350521315e-242, [0.0], [], 0.0),
                                             BucketTiming(1.0, 1.0, [0.0], [], 0.0)])
def test_spans_tile_the_step_and_never_hold_back_a_bucket(compute, bs):
    # buckets fill in index order during backward, and are ready no later than backward ends
    bs = [BucketTiming(b.ready_s * compute, b.compress_s, list(b.rounds_s), list(b.between_s), b.decode_s)
          for b in sorted(bs, key=lambda b: b.ready_s)]
    m = model_step(compute, bs)
    eps = 1e-9 * (1 + m.step_s)
    cpu = lane(m.spans, "compute")
    # The compute thread is busy or waiting from 0 to the end of the step, never two things at once.
    t = 0.0
    for s in cpu:
        assert s.start == pytest.approx(t, abs=eps) and s.end > s.start
        t = s.end
    assert t == pytest.approx(m.step_s, abs=eps)
    assert total(cpu, "wait") == pytest.approx(m.comm_s, abs=eps)
    assert total(cpu, "encode") + total(cpu, "between") + total(cpu, "decode") == pytest.approx(m.compress_s, abs=eps)
    assert total(cpu, "backward") == pytest.approx(compute, abs=eps)
    # The link: one round at a time, and a round goes as soon as it is launched and the link is free
    # (no encode or decode of another bucket holds it back).
    link = lane(m.spans, "link")
    assert sum(s.end - s.start for s in link) == pytest.approx(m.link_s, abs=eps)
    launched = {(s.bucket, 0): s.end for s in cpu if s.kind == "encode"}
    launched.update({(s.bucket, s.round + 1): s.end for s in cpu if s.kind == "between"})
    free = 0.0
    for s in link:
        assert s.start >= free - eps
        if (s.bucket, s.round) in launched:  # (an encode of zero length has no span)
            assert s.start == pytest.approx(max(free, launched[(s.bucket, s.round)]), abs=eps)
        free = s.end


def test_sim_engine_keeps_the_modelled_schedule_of_its_last_step():
    torch.manual_seed(0)
    world = SimWorld(3, bandwidth="10mbit", latency="1ms")
    model = Net(hidden=64)
    engine = attach(model, "topk:ratio=0.2,ef=true", world, bucket_cap_mb=0.004, min_compress_numel=64)
    stats = run_step(engine, model, data(3))
    cpu = lane(engine.last_schedule, "compute")
    assert cpu[-1].end == pytest.approx(stats.step_s)
    assert total(cpu, "wait") == pytest.approx(stats.comm_s)
    assert {s.bucket for s in engine.last_schedule if s.kind == "round"} == set(range(len(engine.buckets)))


@pytest.mark.timeout(60)
def test_real_backend_path_measures_every_bucket_and_round():
    """The per-rank engine (real backends) records its spans from timestamps, two rounds for PowerSGD."""
    torch.manual_seed(1)
    base = Net()
    world = SimWorld(2, threaded=True, timeout=30)
    out: dict[int, tuple] = {}

    def rank_main(r: int) -> None:
        model = copy.deepcopy(base)
        engine = attach(model, "powersgd:rank=2", world[r], bucket_cap_mb=0.002, min_compress_numel=32)
        loss_of(model, data(2)[r]).backward()
        out[r] = (engine.finalize(), engine.last_schedule, len(engine.buckets))

    run_ranks(rank_main, 2)
    for stats, spans, nb in out.values():
        assert all(0 <= s.start < s.end for s in spans)
        assert max(s.end for s in spans) <= stats.step_s + 1e-6
        assert {s.bucket for s in spans if s.kind == "encode"} == set(range(nb))
        assert {s.bucket for s in spans if s.kind == "decode"} == set(range(nb))
        rounds = {(s.bucket, s.round) for s in spans if s.lane == "link"}
        assert {(b, 1) for b, _ in rounds} & rounds, "PowerSGD's second round is on the link"
        assert any(s.kind == "between" for s in spans)
        # every round is in flight from its launch: it starts no earlier than its encode ended
        for s in spans:
            if s.lane == "link" and s.round == 0:
                enc = next(e for e in spans if e.kind == "encode" and e.bucket == s.bucket)
                assert s.start >= enc.end - 1e-9


def test_train_writes_the_schedule_and_plot_draws_it(tmp_path, corpus, capsys):
    args = ["train", "--model", "bert-tiny", "--corpus", str(corpus), "--vocab-size", "512", "--workers", "2",
            "--batch-size", "2", "--seq-len", "32", "--steps", "2", "--eval-batches", "0", "--checkpoint-every", "0",
            "--bucket-cap-mb", "1", "--bandwidth", "100mbit", "--no-progress"]
    for spec in ("none", "onebit"):
        assert main([*args, "--compressor", spec, "--out", str(tmp_path / "runs" / spec)]) == 0
        doc = json.loads((tmp_path / "runs" / spec / "schedule.json").read_text())
        assert doc["step"] == 2 and doc["clock"] == "modelled"
        metrics = [json.loads(line) for line in (tmp_path / "runs" / spec / "metrics.jsonl").read_text().splitlines()]
        spans = [Span(**s) for s in doc["spans"]]
        assert max(s.end for s in spans) == pytest.approx(doc["step_s"])
        assert doc["step_s"] == pytest.approx(metrics[-1]["step_s"] - metrics[-1]["opt_s"])
        assert total(spans, "wait") == pytest.approx(metrics[-1]["comm_s"])
    assert main(["plot", str(tmp_path / "runs" / "onebit"), "--figures", "schedule"]) == 0
    assert_image(tmp_path / "runs" / "onebit" / "figures" / "schedule.png")
    # a damaged schedule.json skips that run with the reason, never a traceback
    (tmp_path / "runs" / "none" / "schedule.json").write_text('{"spans": [{"lane": "link"}]}')
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "runs" / "none"), "--figures", "schedule"]) == 0
    assert "schedule.json" in capsys.readouterr().out
    # DiLoCo has no per-step exchange: no schedule, and the figure says why it is skipped
    assert main([*args, "--sync", "diloco:every=2", "--out", str(tmp_path / "diloco")]) == 0
    assert not (tmp_path / "diloco" / "schedule.json").exists()
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "diloco"), "--figures", "schedule"]) == 0
    assert "schedule.json" in capsys.readouterr().out
