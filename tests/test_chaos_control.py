"""The control-plane probe of the chaos harness (``gradzip chaos run --probe-control``,
``gradzip chaos control-plane``; docs/fault-tolerance.md "The control plane on a slow link"): the
split of the samples into idle and during an exchange and their statistics, the Lighthouse's
status page parsed for heartbeat ages, the report's files and bad input; a real request against a
Lighthouse; and the priority filters on the testbed (root)."""

from __future__ import annotations

import json
import subprocess

import pytest

from gradzip.chaos import control
from gradzip.cli import main
from gradzip.netem.iproute import HOST_IF

STATUS = b"""<h2>Heartbeats</h2><ul>
  <li class="heartbeat">
    replica_0:abc: seen 0.10515958s ago
  </li>
  <li class="heartbeat">
    replica_1:def: seen 2.5s ago
  </li></ul>"""


def _sample(t: float, rtt: float | None, backlog: list[int], age: float | None = None) -> dict:
    return {"t": t, "rtt_ms": rtt, "backlog": backlog, "hb_age_ms": age}


def test_heartbeat_age_is_the_oldest_listed():
    assert control.heartbeat_age_ms(STATUS) == 2500.0
    assert control.heartbeat_age_ms(b"<h2>Heartbeats</h2><ul></ul>") is None


def test_summarize_splits_idle_from_loaded_by_the_backlog():
    samples = [_sample(0, 1.0, [0, 0], 100), _sample(1, 3.0, [0, 0], 200), _sample(2, 2.0, [0, 0]),
               _sample(3, 900.0, [64_000, 0], 1000), _sample(4, 1500.0, [0, 200_000], 3000),
               _sample(5, None, [100_000, 100_000]), _sample(6, 50.0, [10, 0])]  # 10 B queued: neither
    s = control.summarize(samples)
    assert s["samples"] == 7 and s["max_backlog_bytes"] == 200_000
    assert s["idle_rtt_ms"] == {"n": 3, "median": 2.0, "p90": 3.0, "max": 3.0}
    assert s["loaded_rtt_ms"] == {"n": 2, "median": 1200.0, "p90": 1500.0, "max": 1500.0}
    assert (s["idle_failed"], s["loaded_failed"]) == (0, 1)
    assert s["heartbeat_age_ms"] == {"n": 4, "median": 600.0, "p90": 3000.0, "max": 3000.0}
    assert control.summarize([])["loaded_rtt_ms"]["median"] is None


def test_report_reads_the_runs_and_tabulates(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "settings.json").write_text(json.dumps({"link_rate": "10mbit", "compressor": "none",
                                                   "control_priority": True}))
    (run / "summary.json").write_text(json.dumps({"participation_ok": True, "participation": [
        {"participants": 2, "live": 2}, {"participants": 1, "live": 2}]}))
    lines = [json.dumps(_sample(0, 1.5, [0, 0], 90)), json.dumps(_sample(1, 4.0, [0, 70_000], 120)), '{"t": 2, "rt']
    (run / control.PROBE_FILE).write_text("\n".join(lines))  # a torn last line is left out
    assert main(["chaos", "control-plane", str(run), "--out", str(tmp_path / "cp")]) == 0
    row = json.loads((tmp_path / "cp" / "control_plane.json").read_text())["runs"][0]
    assert row["samples"] == 2 and row["syncs"] == 2 and row["min_participants"] == 1 and row["control_priority"]
    assert row["loaded_rtt_ms"]["max"] == 4.0
    md = (tmp_path / "cp" / "control_plane.md").read_text()
    assert "| 10mbit | on | 1.5 / 1.5 | 1: 4 / 4 / 4 | 0 | 105 / 120 | 70000 | 2 | 1 |" in md
    assert md.startswith("# The control plane's latency") and control.table([row]) in capsys.readouterr().out


def test_bad_input_is_one_line(tmp_path, capsys):
    (tmp_path / "plain").mkdir()
    assert main(["chaos", "control-plane", str(tmp_path / "plain"), "--out", str(tmp_path / "cp")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--probe-control" in err and not (tmp_path / "cp").exists()
    assert main(["chaos", "run", "--hosts", "1", "--groups", "2", "--probe-control", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--hosts >= 2" in err and not (tmp_path / "x").exists()


def test_request_reads_a_lighthouse_status():
    pytest.importorskip("torchft")
    from gradzip.engine import _ft

    lh = _ft.start_lighthouse(min_replicas=1)
    try:
        port = int(lh.address().rsplit(":", 1)[1])
        rtt, reply = control.request("127.0.0.1", port, timeout=10)
        assert rtt is not None and rtt > 0 and b"Heartbeats" in reply
        assert control.request("127.0.0.1", 9, timeout=1) == (None, b"")  # nothing listens: a failed sample
    finally:
        lh.shutdown()


@pytest.mark.root
@pytest.mark.timeout(120)
def test_control_port_is_filtered_into_the_priority_class(tmp_path):
    from gradzip.chaos import harness
    from gradzip.netem import testbed

    try:
        testbed.check_privileges()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"needs root for the testbed: {e}")
    h = harness.Harness(harness.Settings(out=str(tmp_path), hosts=2, groups=2, link_rate="10mbit", port=29510,
                                         prefix="gzcpt"))
    h.events = (tmp_path / "events.jsonl").open("w")
    try:
        h._testbed_up()
        assert h.tb is not None
        for host in range(2):
            out = subprocess.run(["tc", "-n", h.tb.host_ns(host), "filter", "show", "dev", HOST_IF, "parent", "1:"],
                                 capture_output=True, text=True, check=True).stdout
            # u32 shows the 32-bit word at offset 20 (IHL 5: TCP's ports): sport, then dport
            assert "match 73460000/ffff0000 at 20" in out and "match 00007346/0000ffff at 20" in out, out
            assert out.count("flowid 1:5") >= 3  # the ACK filter and the two port filters
    finally:
        testbed.down("gzcpt")
