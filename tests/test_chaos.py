"""The chaos harness (``gradzip chaos``, docs/fault-tolerance.md "Chaos harness"): the fault schedule
is a function of its seed; the faults it injects do what the harness counts on, on replica groups
as processes with an in-process Lighthouse (a stalled group is dropped from the quorum and heals
when it resumes; a late joiner heals and matches); the report's arithmetic on a run's files; the
partition primitive on the testbed (root); and bad input."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from gradzip.chaos import report, schedule
from gradzip.cli import main

sys.path.insert(0, str(Path(__file__).parent))


# ---------------------------------------------------------------------- the schedule
def test_schedule_is_a_function_of_the_seed():
    args = dict(rate=4.0, duration=600.0, groups=4, hosts=2, kinds=schedule.KINDS, recovery=5.0, stall=10.0,
                partition=6.0)
    a, b = schedule.build(seed=7, **args), schedule.build(seed=7, **args)
    assert a == b and len(a) > 10
    assert schedule.build(seed=8, **args) != a
    assert [f.t for f in a] == sorted(f.t for f in a) and all(0 < f.t < 600 for f in a)
    for f in a:
        assert f.target in range(2 if f.kind == "partition" else 4)
        assert f.duration == {"kill": 5.0, "stall": 10.0, "partition": 6.0}[f.kind]
    assert {f.kind for f in a} == set(schedule.KINDS)
    assert schedule.build(seed=7, **{**args, "rate": 0.0}) == []
    # exponential inter-arrival times: over many faults their mean is 60 / rate seconds
    many = schedule.build(seed=1, **{**args, "rate": 60.0, "duration": 5000.0})
    gaps = [b.t - a.t for a, b in zip(many, many[1:])]
    assert abs(sum(gaps) / len(gaps) - 1.0) < 0.05
    assert schedule.late_starts(4, 2, 30.0) == {2: 30.0, 3: 60.0}


# ---------------------------------------------------------------------- faults on replica groups
pytest.importorskip("torchft")
from test_ft import G0, G1, groups, lighthouse, records, wait_for  # noqa: E402, F401 (fixtures)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_stalled_group_is_dropped_then_heals(groups, tmp_path):  # noqa: F811
    """SIGSTOP group 1 between syncs: its heartbeat stops, the Lighthouse drops it and group 0
    commits alone. After SIGCONT it is behind: it heals from group 0 (the same digest in the same
    sync) and both end bit-identical."""
    go_b, go_a = tmp_path / "go_b", tmp_path / "go_a"
    groups.start("a", group=0, steps=20, pause_at=12, resume_file=str(go_a))
    b = groups.start("b", group=1, steps=20, pause_at=6, resume_file=str(go_b))
    wait_for(lambda: any(r["step"] == 6 and r["committed"] for r in records(tmp_path / "b.jsonl")), "b's sync")
    os.kill(b.pid, signal.SIGSTOP)
    go_b.touch()  # b sees it only once it runs again
    wait_for(lambda: any(r["members"] == [G0] and r["committed"] for r in records(tmp_path / "a.jsonl")),
             "a's sync without b")
    os.kill(b.pid, signal.SIGCONT)
    go_a.touch()
    res = groups.results(2)
    assert res[0] == res[1] and res[0][2] == 20
    a, brec = records(tmp_path / "a.jsonl"), records(tmp_path / "b.jsonl")
    alone = [r for r in a if r["members"] == [G0] and r["committed"]]
    assert alone and all(r["participants"] == [G0] for r in alone)
    heal = next(r for r in brec if r["healed"] and not r["join"])  # not the founding sync's
    assert heal["committed"] and heal["heals"] == [G1]
    same = next(r for r in a if r["quorum_id"] == heal["quorum_id"] and r["sync"] == heal["sync"])
    assert same["digest"] == heal["digest"] and not same["healed"]
    assert same["step"] == heal["step"] >= 12  # b, stopped at 6, took a's step (12 or 14: a goes on at once)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_late_joiner_heals_and_matches(groups, tmp_path):  # noqa: F811
    """Two groups found the run and sync five times; a third (groups=3) starts then: its join
    sync heals it from a founder at their step, and the three end with one digest."""
    go = tmp_path / "go"
    groups.start("a", group=0, steps=20, pause_at=10, resume_file=str(go))
    groups.start("b", group=1, steps=20, pause_at=10, resume_file=str(go))
    for n in ("a", "b"):
        wait_for(lambda n=n: any(r["step"] == 10 and r["committed"] for r in records(tmp_path / f"{n}.jsonl")),
                 f"{n}'s 5th sync")
    groups.start("c", group=2, groups=3, steps=20, ready_file=str(tmp_path / "ready"))
    wait_for((tmp_path / "ready").exists, "c's manager")
    go.touch()
    res = groups.results(3)
    assert res[0] == res[1] == res[2] and res[2][2] == 20
    join = next(r for r in records(tmp_path / "c.jsonl") if r["committed"])
    assert join["join"] and join["healed"] and join["step"] == 12 and join["heals"] == ["gradzip_group_2"]
    founder = next(r for r in records(tmp_path / "a.jsonl") if r["sync"] == join["sync"] and r["committed"])
    assert founder["digest"] == join["digest"] and len(founder["members"]) == 3


# ---------------------------------------------------------------------- the report's arithmetic
def _write_run(out: Path, rate: float = 6.0) -> None:
    """Two groups, H = 4, batch 2 x 8 = 16 tokens: founding at t=10, syncs every 2 s; group 1 is
    killed at rel 3 and its restart heals at rel 9 (healed digest equal to group 0's)."""
    out.mkdir()
    (out / "settings.json").write_text(json.dumps({
        "groups": 2, "hosts": 0, "duration": 10.0, "batch_size": 2, "seq_len": 8, "rate": rate, "kinds": ["kill"],
        "seed": 0, "model": "bert-tiny", "link_rate": "100mbit", "compressor": "topk:ratio=0.01,ef=true",
        "every": 4, "min_replicas": 1, "recovery": 1.0}))
    ev = [{"t": 0.0, "event": "launch", "group": 0, "inc": 0}, {"t": 0.0, "event": "launch", "group": 1, "inc": 0},
          {"t": 10.0, "event": "founding"}, {"t": 13.0, "event": "kill", "fault": 0, "group": 1, "inc": 0},
          {"t": 15.0, "event": "launch", "group": 1, "inc": 1}, {"t": 30.0, "event": "end"}]
    (out / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))

    def ft(t, g, inc, sync, members, parts, digest, healed=False, join=False, sync_s=0.1):
        w = {f"gradzip_group_{m}": (0.0 if sync == 1 or (healed and m == g) else 4.0) for m in members}
        rec = {"step": 0, "sync": sync, "quorum_id": 1, "members": [f"gradzip_group_{m}" for m in members],
               "participants": [f"gradzip_group_{m}" for m in parts], "heals": [], "weights": w,
               "committed": True, "healed": healed, "join": join, "digest": digest, "sync_s": sync_s}
        return {"t": t, "group": g, "inc": inc, "kind": "ft", "rec": rec}

    rows = [ft(10.0, 0, 0, 1, [0, 1], [], "d1", join=True), ft(10.0, 1, 0, 1, [0, 1], [], "d1", True, True),
            ft(12.0, 0, 0, 2, [0, 1], [0, 1], "d2"), ft(12.0, 1, 0, 2, [0, 1], [0, 1], "d2"),
            ft(14.0, 0, 0, 3, [0], [0], "d3"), ft(16.0, 0, 0, 4, [0], [0], "d4"),
            ft(19.0, 0, 0, 5, [0, 1], [0], "d5"), ft(19.0, 1, 1, 5, [0, 1], [0], "d5", True, True, sync_s=1.5)]
    rows += [{"t": 18.0 + 0.1 * i, "group": 0, "inc": 0, "kind": "step", "step": i, "loss": 5.0,
              "eval_loss": None} for i in range(10)]
    rows += [{"t": 19.5 + 0.1 * i, "group": 1, "inc": 1, "kind": "step", "step": i, "loss": 5.2,
              "eval_loss": 6.0 if i == 3 else None} for i in range(4)]
    (out / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_counts_what_the_files_say(tmp_path):
    _write_run(tmp_path / "run")
    s = report.summarize(tmp_path / "run", loss_bound=0.5)
    # committed in [0, 10]: syncs 2, 3, 4 (weights 4+4, 4, 4) and 5 (group 0's 4): 20 inner steps
    assert s["committed_syncs"] == 4 and s["committed_inner_steps"] == 20.0
    assert s["goodput_tokens_per_s"] == 20 * 16 / 10.0
    kill = s["faults"][0]
    assert kill["kind"] == "kill" and kill["recovery_s"] == 6.0  # rel 3 -> the heal at rel 9
    assert kill["startup_s"] == 2.5 and kill["healed"]  # launched at rel 5, asked at 9 - 1.5
    assert s["heals_bit_exact"] == s["heals_checked"] == 2  # the founding's and the restart's
    assert s["final"] == {"surviving": [0, 1], "sync": 5, "digests": {"0": "d5", "1": "d5"}, "equal": True}
    assert [(p["participants"], p["live"]) for p in s["participation"]] == [(2, 2), (1, 1), (1, 1), (1, 1)]
    [jump] = s["loss_jumps"]  # the restart's heal (the founding sync's heals are not counted)
    assert jump["group"] == 1 and abs(jump["jump"] - 0.2) < 1e-9 and s["loss_continuous"]
    assert s["held_out"]["mean"] == s["held_out"]["late_mean"] == 6.0
    assert "goodput 32.0 tokens/s" in (tmp_path / "run" / "summary.md").read_text()


def test_a_late_joiner_is_listed_with_its_time_to_join(tmp_path):
    run = tmp_path / "run"
    _write_run(run)
    with (run / "events.jsonl").open("a") as f:  # group 2 starts 4 s after the founding sync
        for ev in ("launch", "late"):
            f.write(json.dumps({"t": 14.0, "event": ev, "group": 2, "inc": 0}) + "\n")
    rec = {"step": 0, "sync": 5, "quorum_id": 1, "members": ["gradzip_group_0", "gradzip_group_2"],
           "participants": ["gradzip_group_0"], "heals": ["gradzip_group_2"], "weights": {}, "committed": True,
           "healed": True, "join": True, "digest": "d5", "sync_s": 1.0}
    with (run / "timeline.jsonl").open("a") as f:
        f.write(json.dumps({"t": 19.0, "group": 2, "inc": 0, "kind": "ft", "rec": rec}) + "\n")
    s = report.summarize(run)
    late = next(f for f in s["faults"] if f["kind"] == "late join")
    got = (late["t"], late["target"], late["recovery_s"], late["startup_s"], late["healed"])
    assert got == (4.0, 2, 5.0, 4.0, True)
    assert s["faults_injected"] == 1  # the kill; a late join is not a fault of the rate
    assert s["heals_bit_exact"] == s["heals_checked"] == 3


def test_compare_divides_by_the_baseline_and_asks_the_model(tmp_path):
    from gradzip.chaos import compare

    _write_run(tmp_path / "f0", rate=0.0)
    _write_run(tmp_path / "f6")
    base = report.summarize(tmp_path / "f0")
    ev = tmp_path / "f6" / "events.jsonl"  # the faulty run commits half the baseline's syncs' weight
    rows = [json.loads(line) for line in (tmp_path / "f6" / "timeline.jsonl").read_text().splitlines()]
    for r in rows:
        if r["kind"] == "ft":
            r["rec"]["weights"] = {k: v / 2 for k, v in r["rec"]["weights"].items()}
    (tmp_path / "f6" / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ev.exists()
    res = compare.compare([str(tmp_path / "f0"), str(tmp_path / "f6")], tmp_path / "cmp")
    f0, f6 = res["runs"]
    assert res["baseline_goodput_tokens_per_s"] == base["goodput_tokens_per_s"] == 32.0
    assert f0["goodput_ratio"] == 1.0 and f0["model_goodput"] == 1.0 and f6["goodput_ratio"] == 0.5
    assert res["round_s"] == 2.0 and res["startup_s"] == 2.5  # sync gaps 2, 2, 3: median 2
    assert 0 < f6["model_goodput"] < 1 and "--failures-per-minute 6 --recovery 3.50s" in f6["model_command"]
    assert f6["model_error"] == abs(0.5 - f6["model_goodput"]) / f6["model_goodput"]
    for name in ("compare.json", "compare.md", "goodput.png", "participation.png", "loss.png"):
        assert (tmp_path / "cmp" / name).stat().st_size > 0


def test_compare_models_sparseloco_runs_and_refuses_mixed_modes(tmp_path, capsys):
    from gradzip.chaos import compare

    for name, rate in (("f0", 0.0), ("f6", 6.0)):
        _write_run(tmp_path / name, rate=rate)
        st = json.loads((tmp_path / name / "settings.json").read_text())
        (tmp_path / name / "settings.json").write_text(json.dumps({**st, "mode": "ftsparseloco", "compressor": ""}))
    res = compare.compare([str(tmp_path / "f0"), str(tmp_path / "f6")], tmp_path / "cmp")
    cmd = res["runs"][1]["model_command"]
    assert "--sync sparseloco:every=4" in cmd and "--compressor" not in cmd and 0 < res["runs"][1]["model_goodput"] < 1
    _write_run(tmp_path / "dl", rate=0.0)  # an ftdiloco run (no mode in its settings: the default)
    assert main(["chaos", "compare", str(tmp_path / "f0"), str(tmp_path / "dl"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mix --mode ftdiloco and ftsparseloco" in err


# ---------------------------------------------------------------------- the partition, on the testbed
@pytest.mark.root
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_partition_drops_a_hosts_egress_then_restores_it(tmp_path):
    from gradzip.chaos import harness
    from gradzip.netem import testbed

    try:
        testbed.check_privileges()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"needs root for the testbed: {e}")
    h = harness.Harness(harness.Settings(out=str(tmp_path), hosts=2, groups=2, prefix="gzchaost"))
    h.events = (tmp_path / "events.jsonl").open("w")
    try:
        h._testbed_up()
        assert h.tb is not None

        def connect() -> str:
            import subprocess

            code = (f"import socket;s=socket.socket();s.settimeout(1)\ntry: s.connect(('{h.tb.host_addr(0)}', 9))\n"
                    "except Exception as e: print(type(e).__name__)")
            return subprocess.run(["ip", "netns", "exec", h.tb.host_ns(1), sys.executable, "-c", code],
                                  capture_output=True, text=True, timeout=30).stdout.strip()

        assert connect() == "ConnectionRefusedError"  # host 0 answers: nothing listens on port 9
        h._partition(1)
        assert connect() in ("TimeoutError", "timeout")  # host 1's SYN never leaves
        h._unpartition(1)
        assert connect() == "ConnectionRefusedError"
    finally:
        testbed.down("gzchaost")


# ---------------------------------------------------------------------- warm spares
FAKE_TRAIN = """import sys, time, pathlib
sync = sys.argv[sys.argv.index("--sync") + 1]
go = dict(kv.split("=", 1) for kv in sync.split(":", 1)[1].split(",")).get("standby")
print("started", " ".join(sys.argv[1:]), flush=True)
if go:
    pathlib.Path(go + ".waiting").touch()
while go and not pathlib.Path(go).exists():
    time.sleep(0.02)
print("joined", flush=True)
time.sleep(60)
"""


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_restart_brings_in_a_built_spare_and_starts_another(tmp_path):
    """--warm-spare 2: each group's spares are built (``go.waiting``) before the founders start; a
    restart brings in a built one (its go file, normal priority, its launch event then) and starts
    a new one behind it at niceness 19; with no live spare left the restart is cold. Teardown ends
    every process, spares included."""
    from gradzip.chaos import harness, procs

    fake = tmp_path / "fake_python.py"
    fake.write_text(FAKE_TRAIN)
    wrapper = tmp_path / "python"  # stands in for the interpreter: "-m gradzip train ..." -> the fake
    wrapper.write_text(f"#!/bin/sh\nshift 2\nexec {sys.executable} {fake} \"$@\"\n")
    wrapper.chmod(0o755)
    out = tmp_path / "run"
    h = harness.Harness(harness.Settings(out=str(out), hosts=0, groups=2, ranks=2, warm_spare=2,
                                         python=str(wrapper)))
    out.mkdir()
    h.events = (out / "events.jsonl").open("a")
    h.lighthouse_addr = "http://127.0.0.1:1"

    def log(p: harness.Proc) -> bytes:
        return (p.out.parent / f"log{p.inc}.txt").read_bytes()

    try:
        h._build_spares()
        assert [[(p.inc, harness._ready(p)) for p in h.spares[g]] for g in (0, 1)] == [[(0, True), (1, True)]] * 2
        for g in range(2):
            h._launch(g)
        first = h.spares[0][0]
        h.procs[0].popen.kill()
        p = h._activate(0)
        assert p is first and h.procs[0] is first and (first.out / harness.GO_FILE).exists()
        behind = h.spares[0][-1]
        assert [q.inc for q in h.spares[0]] == [1, 3] and behind.popen.poll() is None
        wait = time.monotonic() + 30
        while b"joined" not in log(first):
            assert time.monotonic() < wait, "the spare never saw its go file"
            time.sleep(0.05)
        assert b"standby=" in log(first) and b"standby=" not in log(h.procs[1])
        assert b"--workers 2 " in log(first)  # --ranks: each group's gloo ranks
        assert os.getpriority(os.PRIO_PROCESS, behind.popen.pid) == procs.SPARE_NICE  # a replacement: niced
        if os.geteuid() == 0:  # brought in: the normal priority (lowering it needs root)
            assert os.getpriority(os.PRIO_PROCESS, first.popen.pid) == 0
        for q in h.spares[1]:
            q.popen.kill()
            q.popen.wait()
        h._tick_spares()
        assert h.spares[1] == []
        cold = h._activate(1)  # no spare left: a new process, no go file needed; a new spare behind it
        assert b"standby=" not in log(cold) and [q.inc for q in h.spares[1]] == [cold.inc + 1]
    finally:
        h._teardown()
    assert all(p.popen.poll() is not None for p in h.history)
    ev = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    launches = [(e["group"], e["inc"], e.get("warm", False)) for e in ev if e["event"] == "launch"]
    assert launches == [(0, 2, False), (1, 2, False), (0, 0, True), (1, 3, False)]
    spares = [(e["group"], e["inc"], e["nice"]) for e in ev if e["event"] == "spare"]
    assert spares == [(0, 0, False), (0, 1, False), (1, 0, False), (1, 1, False), (0, 3, True), (1, 4, True)]
    assert sorted((e["group"], e["inc"]) for e in ev if e["event"] == "spare-exit") == [(1, 0), (1, 1)]
    assert next(e for e in ev if e["event"] == "spares")["ready"] == 4


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv, words", [
    (["--rate", "100potatoes"], "rate"),
    (["--kinds", "kill,boom"], "--kinds"),
    (["--faults-per-minute", "-1"], "--faults-per-minute"),
    (["--hosts", "0", "--kinds", "partition", "--faults-per-minute", "1"], "testbed"),
    (["--min-replicas", "5"], "--min-replicas"),
    (["--late", "4"], "--late"),
    (["--ranks", "0"], "--ranks"),
    (["--warm-spare", "-1"], "--warm-spare"),
    (["--mode", "ftsparseloco", "--compressor", "topk"], "own codec"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, words):
    assert main(["chaos", "run", "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and err.startswith("gradzip chaos:")
    assert not (tmp_path / "x").exists()


def test_no_root_and_a_used_out_are_one_line(tmp_path, capsys, monkeypatch):
    from gradzip.errors import GradzipError
    from gradzip.netem import testbed

    def no_root() -> None:
        raise GradzipError("creating network namespaces needs root")

    monkeypatch.setattr(testbed, "check_privileges", no_root)
    assert main(["chaos", "run", "--out", str(tmp_path / "x")]) == 2
    assert "the emulated testbed needs root" in capsys.readouterr().err
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    assert main(["chaos", "run", "--hosts", "0", "--out", str(used)]) == 2
    assert "not empty" in capsys.readouterr().err and (used / "keep.txt").read_text() == "mine"
