"""``gradzip netem``: the namespace testbed. Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and working
``ip netns``; skipped with the reason otherwise. Every test uses its own namespace prefix and
state directory, and removes what it created."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gradzip.netem import testbed as tb
from gradzip.netem.testbed import Shaping

REPO = Path(__file__).resolve().parents[1]
SO_RCVBUFFORCE = 33  # Linux; not exported by the socket module


def _skip_reason() -> str | None:
    try:
        tb.check_privileges()
    except tb.NetemError as e:
        return str(e)
    probe = f"gzchk{os.getpid()}"
    p = subprocess.run([tb.tool("ip"), "netns", "add", probe], capture_output=True, text=True)
    if p.returncode != 0:
        return f"`ip netns add` does not work here: {p.stderr.strip()}"
    subprocess.run([tb.tool("ip"), "netns", "del", probe], capture_output=True)
    return None


REASON = _skip_reason()
_skip_without_netns = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")


def needs_netns(test):
    """Marks a test `root` (namespaces, links, qdiscs) and `distributed` (sockets, processes), and
    skips it, with the reason, where namespaces cannot be made."""
    return pytest.mark.root(pytest.mark.distributed(_skip_without_netns(test)))


@pytest.fixture
def prefix(tmp_path, monkeypatch):
    """A prefix no user testbed has, its own state directory, and a guaranteed clean-up."""
    name = f"t{os.getpid() % 100000}{int(time.time() * 1000) % 1000}"
    monkeypatch.setenv("GRADZIP_NETEM_STATE_DIR", str(tmp_path / "state"))
    yield name
    for ns in tb.owned_namespaces(name, tb.list_namespaces()):
        subprocess.run([tb.tool("ip"), "netns", "del", ns], capture_output=True)


def ours(prefix: str) -> list[str]:
    return sorted(tb.owned_namespaces(prefix, tb.list_namespaces()))


def root_links() -> list[str]:
    """Interface names in the root namespace (the testbed must never add any)."""
    out = subprocess.run([tb.tool("ip"), "-j", "link", "show"], capture_output=True, text=True, check=True).stdout
    return sorted(d["ifname"] for d in json.loads(out))


def gradzip(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gradzip", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=REPO)


def test_without_privileges_the_error_says_what_is_needed(monkeypatch):
    monkeypatch.setattr(tb, "_effective_caps", lambda: 0)
    with pytest.raises(tb.NetemError, match="needs root .*CAP_NET_ADMIN and CAP_SYS_ADMIN"):
        tb.up(2, Shaping(1e8), prefix="nopriv")


def test_bad_input_is_refused_before_anything_is_built():
    with pytest.raises(tb.GradzipError, match="outside the benchmarking range"):
        tb.up(2, Shaping(1e8), prefix="badnet", subnet="10.0.0.0/24")
    with pytest.raises(tb.GradzipError, match="rate must be positive"):
        Shaping(0)
    with pytest.raises(tb.GradzipError, match="loss must be a percentage"):
        Shaping(1e8, loss_pct=100)
    with pytest.raises(tb.GradzipError, match="bad testbed prefix"):
        tb.up(2, Shaping(1e8), prefix="Bad-Prefix")


@needs_netns
@pytest.mark.timeout(60)
def test_up_status_reshape_down_idempotent(prefix):
    t, what = tb.up(3, Shaping(100e6), prefix=prefix)
    assert what == "created"
    assert ours(prefix) == sorted([f"{prefix}-br", f"{prefix}-h0", f"{prefix}-h1", f"{prefix}-h2"])
    addr = subprocess.run([tb.tool("ip"), "-n", f"{prefix}-h2", "-j", "addr", "show", "dev", "eth0"],
                          capture_output=True, text=True, check=True).stdout
    assert json.loads(addr)[0]["addr_info"][0]["local"] == "198.18.0.3" == t.host_addr(2)
    # same parameters: nothing changes
    assert tb.up(3, Shaping(100e6), prefix=prefix)[1] == "unchanged"
    # new shaping: reshaped in place, and tc shows the new rate
    assert tb.up(3, Shaping(40e6, loss_pct=1.0), prefix=prefix)[1] == "reshaped"
    cls = subprocess.run([tb.tool("tc"), "-n", f"{prefix}-h1", "class", "show", "dev", "eth0"],
                         capture_output=True, text=True, check=True).stdout
    assert "class htb 1:1 root rate 40Mbit ceil 40Mbit" in cls and "class htb 1:20" in cls  # 1:20: loss
    # another host count: a clear error, nothing touched
    with pytest.raises(tb.NetemError, match="is up with 3 hosts"):
        tb.up(2, Shaping(40e6), prefix=prefix)
    st = tb.status(prefix)
    assert st["state"] == "up" and st["hosts"] == 3 and len(st["counters"]) == 3
    assert st["shaping"] == {"rate_bps": 40e6, "delay_s": 0.0, "loss_pct": 1.0}
    # the CLI, from another process, sees the same testbed through the state file
    p = gradzip("netem", "status", "--prefix", prefix)
    assert p.returncode == 0 and "198.18.0.3" in p.stdout and "40mbit, loss 1%" in p.stdout
    assert len(tb.down(prefix)) == 4 and ours(prefix) == []
    assert tb.down(prefix) == [] and tb.status(prefix) is None
    p = gradzip("netem", "down", "--prefix", prefix)
    assert p.returncode == 0 and "nothing was up" in p.stdout


@needs_netns
@pytest.mark.timeout(60)
@pytest.mark.parametrize("step", ["bridge", "host:1", "shape:2"])
def test_failure_half_way_leaves_nothing(prefix, monkeypatch, step):
    links = root_links()
    monkeypatch.setenv(tb.FAIL_ENV, f"raise:{step}")
    with pytest.raises(tb.NetemError, match="injected failure"):
        tb.up(3, Shaping(100e6), prefix=prefix)
    assert ours(prefix) == [] and tb.load(prefix) is None and root_links() == links


@needs_netns
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig, code", [("sigterm", 128 + 15), ("sigint", 130)])
def test_signal_during_up_leaves_nothing(prefix, tmp_path, sig, code):
    links = root_links()
    env = {"GRADZIP_NETEM_STATE_DIR": str(tmp_path / "state"), tb.FAIL_ENV: f"{sig}:shape:1"}
    p = gradzip("netem", "up", "--hosts", "3", "--rate", "100mbit", "--prefix", prefix, env=env)
    assert p.returncode == code, p.stderr
    assert ours(prefix) == [] and not (tmp_path / "state" / f"{prefix}.json").exists()
    assert root_links() == links


def test_cli_bad_flags_exit_2(capsys):
    from gradzip.cli import main

    for argv, needle in ((["--rate=-1gbit"], "bandwidth must be positive"), (["--loss", "150"], "loss must be"),
                         (["--subnet", "192.168.0.0/24"], "outside the benchmarking range")):
        assert main(["netem", "up", "--prefix", "badflags", *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1


RECEIVER = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 5201)); s.listen(1); s.settimeout(30)
    print("ready", flush=True)
    c, _ = s.accept(); c.settimeout(30); n = 0; t0 = None
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        t0 = t0 or time.perf_counter(); n += len(b)
    print(n, time.perf_counter() - t0, flush=True)
""")
SENDER = textwrap.dedent("""
    import socket, sys
    c = socket.create_connection((sys.argv[1], 5201), timeout=30); left = int(sys.argv[2]); buf = bytes(1 << 16)
    while left > 0:
        left -= c.send(buf[:left])
    c.close()
""")


@needs_netns
@pytest.mark.timeout(60)
def test_shaped_link_throughput_matches_the_rate_in_both_directions_at_once(prefix):
    """Bounded TCP transfers (50 Mbit/s for about 2 s) from host 0 to host 1 and from host 1 to host 0
    at the same time, as in a ring: each goodput, and the bytes each sender's interface transmitted
    per second, are within 10 % of the configured rate (the ACKs of one flow must not queue behind
    the data of the other)."""
    rate = 50e6
    t, _ = tb.up(2, Shaping(rate), prefix=prefix)
    ip = tb.tool("ip")
    nbytes = int(rate / 8 * 2)
    recv = [subprocess.Popen([ip, "netns", "exec", t.host_ns(i), sys.executable, "-c", RECEIVER, t.host_addr(i)],
                             stdout=subprocess.PIPE, text=True) for i in (0, 1)]
    try:
        assert [r.stdout.readline().strip() for r in recv] == ["ready", "ready"]
        before = tb.counters(t)
        send = [subprocess.Popen([ip, "netns", "exec", t.host_ns(i), sys.executable, "-c", SENDER,
                                  t.host_addr(1 - i), str(nbytes)]) for i in (0, 1)]
        assert [p.wait(timeout=30) for p in send] == [0, 0]
        results = [r.stdout.readline().split() for r in recv]
        for r in recv:
            r.wait(timeout=30)
    finally:
        for r in recv:
            r.kill()
    after = tb.counters(t)
    for i, (got, seconds) in enumerate(results):
        wire = after[1 - i].tx_bytes - before[1 - i].tx_bytes  # host 1-i sent to host i
        goodput = int(got) * 8 / float(seconds)
        assert int(got) == nbytes
        assert goodput == pytest.approx(rate, rel=0.10), f"to host {i}: goodput {goodput / 1e6:.1f} Mbit/s"
        assert wire * 8 / float(seconds) == pytest.approx(rate, rel=0.10)
        assert nbytes <= wire < nbytes * 1.05  # headers and the other flow's ACKs: a few per cent at most


def _drained(t: tb.Testbed, host: int, before: tb.HostCounters, expect: int) -> tb.HostCounters:
    """Counters of ``host`` once its shaper has handed on (sent or dropped) ``expect`` packets since
    ``before``, or after 10 s: what is still queued at the moment of reading is neither."""
    deadline = time.monotonic() + 10
    while True:
        c = tb.counters(t, host + 1)[host]
        if (c.tx_packets + c.drops) - (before.tx_packets + before.drops) >= expect or time.monotonic() > deadline:
            return c
        time.sleep(0.05)


@needs_netns
@pytest.mark.timeout(60)
def test_loss_drops_the_configured_fraction_of_packets(prefix):
    """--loss 5: of 20,000 single-packet UDP datagrams sent right after `up`, 4-6 % are dropped
    (±6 standard deviations), by netem where the kernel has it, else by the classic-BPF filter.
    Every datagram is either sent or dropped by the shaper: none waits on ARP (permanent
    neighbour entries), so the count is exact."""
    t, _ = tb.up(2, Shaping(1e9, loss_pct=5.0), prefix=prefix)
    before = tb.counters(t, 1)[0]
    with tb.host_socket(t, 0) as s:
        for _ in range(20_000):
            s.sendto(bytes(200), (t.host_addr(1), 9))
    c = _drained(t, 0, before, 20_000)
    sent, dropped = c.tx_packets - before.tx_packets, c.drops - before.drops
    assert sent + dropped == 20_000
    assert 0.04 < dropped / 20_000 < 0.06


@needs_netns
@pytest.mark.timeout(60)
@pytest.mark.parametrize("hosts", [2, 4])
def test_a_burst_sent_right_after_up_arrives_whole(prefix, hosts):
    """The readiness contract of `up`: every host has a permanent neighbour entry for every other
    host, and a burst of 3,000 UDP datagrams sent the moment `up` returns, from the last host to
    the first, arrives complete. Without the entries the burst waits on ARP, and all but the
    first ``unres_qlen`` datagrams are dropped silently."""
    t, _ = tb.up(hosts, Shaping(1e9), prefix=prefix)
    with tb.host_socket(t, 0) as rx, tb.host_socket(t, hosts - 1) as tx:
        rx.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)  # root: room for the whole burst
        rx.bind((t.host_addr(0), 5300))
        for k in range(3_000):
            tx.sendto(k.to_bytes(4, "big") + bytes(196), (t.host_addr(0), 5300))
        rx.settimeout(5)
        got = set()
        with contextlib.suppress(TimeoutError):
            while len(got) < 3_000:
                got.add(int.from_bytes(rx.recv(256)[:4], "big"))
    assert len(got) == 3_000, f"{3_000 - len(got)} of 3000 datagrams lost"
    for i in range(hosts):
        neigh = json.loads(subprocess.run([tb.tool("ip"), "-n", t.host_ns(i), "-j", "neigh", "show"],
                                          capture_output=True, text=True, check=True).stdout)
        entries = {n["dst"]: (n["lladdr"], n["state"]) for n in neigh}
        assert entries == {t.host_addr(j): (t.host_mac(j), ["PERMANENT"]) for j in range(hosts) if j != i}


# ------------------------------------------------------------------------------ training in the testbed
def test_netem_spelling():
    from gradzip.netem.spec import parse_netem

    s = parse_netem("4:100mbit:0.5ms:0.1%")
    assert (s.hosts, s.shaping) == (4, Shaping(100e6, 0.5e-3, 0.1))
    assert parse_netem("2:1gbit").shaping == Shaping(1e9)
    for bad in ("4", "x:1gbit", "0:1gbit", "2:fast", "2:1gbit:1ms:200", "2:1gbit:1ms:0:9"):
        with pytest.raises(tb.GradzipError, match="--netem|loss"):
            parse_netem(bad)


@needs_netns
@pytest.mark.timeout(60)
def test_testbed_for_a_run_is_removed_afterwards_even_on_failure(prefix):
    from gradzip.netem.spec import parse_netem
    from gradzip.training.launch import testbed_for

    with pytest.raises(RuntimeError, match="boom"):
        with testbed_for(parse_netem("2:100mbit"), prefix) as (t, how):
            assert how == "created" and ours(prefix) == sorted([f"{prefix}-br", f"{prefix}-h0", f"{prefix}-h1"])
            raise RuntimeError("boom")
    assert ours(prefix) == [] and tb.load(prefix) is None


@needs_netns
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_host_training_on_a_shaped_link(prefix, corpus, tmp_path, monkeypatch):
    """`gradzip train --backend gloo --netem 2:50mbit` in a testbed that was up before (3 hosts at
    1 Gbit/s): it runs, the wire bytes agree with the engine's accounting within 5 %, and the testbed
    is still up afterwards with its own shaping restored."""
    tb.up(3, Shaping(1e9), prefix=prefix)
    out = tmp_path / "run"
    env = {"GRADZIP_NETEM_PREFIX": prefix, "OMP_NUM_THREADS": "1"}  # the suite's cache and corpus (conftest)
    p = gradzip("train", "--backend", "gloo", "--netem", "2:50mbit", "--model", "bert-tiny", "--vocab-size", "512",
                "--corpus", str(corpus), "--seq-len", "32", "--batch-size", "4", "--steps", "3", "--eval-batches",
                "0", "--checkpoint-every", "0", "--no-progress", "--out", str(out), env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["workers"] == 2 and s["netem"]["testbed"] == "reshaped" and s["netem"]["rate_bps"] == 50e6
    assert s["netem"]["addresses"] == ["198.18.0.1", "198.18.0.2"]
    # accounting: 2 ranks x 3 steps x bytes_per_step + the start-up broadcast of the fp32 parameters
    assert s["accounted_bytes"] == 2 * 3 * s["bytes_per_step"] + 4 * s["params"]
    assert s["wire_bytes"] == sum(s["wire_bytes_by_host"]) and s["wire_bytes_by_host"][1] > 0
    assert abs(s["wire_overhead"]) < 0.05, s
    assert s["wire_bytes"] / (2 * 3) == pytest.approx(s["wire_bytes_per_step"])
    after = tb.load(prefix)
    assert after is not None and after.shaping == Shaping(1e9) and len(ours(prefix)) == 4


def test_sweep_cells_with_a_real_backend_and_a_bandwidth_run_in_the_testbed():
    from gradzip.experiments.spec import netem_for_cell

    assert netem_for_cell({"backend": "gloo", "workers": 3, "bandwidth": "50mbit"})["netem"] == "3:50mbit"
    assert netem_for_cell({"backend": "mpi", "bandwidth": "1gbit"})["netem"] == "4:1gbit"  # default workers
    for unchanged in ({"backend": "sim", "bandwidth": "50mbit"}, {"backend": "gloo", "workers": 2},
                      {"backend": "gloo", "bandwidth": "1gbit", "netem": "2:10mbit"}):
        assert netem_for_cell(unchanged) == unchanged


@needs_netns
@pytest.mark.timeout(120)
def test_mpi_ranks_run_one_per_host_over_the_testbed(prefix):
    """mpirun inside host 0 with a namespace-entering agent: the backend self-test (every collective,
    checked against sim) passes on 2 ranks in 2 namespaces, and its traffic crosses the shaped links."""
    pytest.importorskip("mpi4py")
    from gradzip.comm.launch import find_mpirun
    from gradzip.training.launch import spawn_mpi

    try:
        find_mpirun()
    except tb.GradzipError as e:
        pytest.skip(str(e))
    t, _ = tb.up(2, Shaping(200e6), prefix=prefix)
    before = tb.counters(t)
    rc = spawn_mpi(t, 2, ["--backend", "mpi", "--check", "--timeout", "60"], {}, timeout=100,
                   module="gradzip.testing.comm_selftest")
    after = tb.counters(t)
    assert rc == 0
    assert all(a.tx_bytes - b.tx_bytes > 10_000 for a, b in zip(after, before))


# ------------------------------------------------------------------------------ several ranks per host
def test_sweep_cells_with_ranks_per_node_run_that_many_ranks_on_each_host():
    from gradzip.errors import SpecError
    from gradzip.experiments.spec import netem_for_cell

    cell = {"backend": "gloo", "workers": 8, "ranks_per_node": 2, "bandwidth": "100mbit"}
    assert netem_for_cell(cell)["netem"] == "4:100mbit"
    assert netem_for_cell({**cell, "backend": "mpi", "ranks_per_node": 8})["netem"] == "1:100mbit"
    assert netem_for_cell({**cell, "ranks_per_node": 1})["netem"] == "8:100mbit"
    with pytest.raises(SpecError, match="workers = 8 is not a multiple of ranks_per_node = 3"):
        netem_for_cell({**cell, "ranks_per_node": 3})
    assert netem_for_cell({**cell, "backend": "sim"}) == {**cell, "backend": "sim"}  # sim models the bandwidth


def test_wire_accounting_with_several_ranks_per_host():
    """The start-up broadcast: with ranks in order (rank r on host r // K), Gloo's binomial tree and
    a linear one cross hosts on world − K edges, a chain on hosts − 1; one rank per host: world − 1.
    Per step: rank 0's inter-node bytes times the ranks that send the same across hosts."""
    from gradzip.training.launch import (
        accounted_bytes,
        broadcast_crossings,
        broadcast_tree,
        inter_multiplier,
        wire_report,
    )

    assert [broadcast_crossings(4, 2, t) for t in ("binomial", "linear", "chain")] == [2, 2, 1]
    assert [broadcast_crossings(12, 3, t) for t in ("binomial", "linear", "chain")] == [9, 9, 3]
    assert all(broadcast_crossings(5, 1, t) == 4 for t in ("binomial", "linear", "chain"))
    assert (broadcast_tree("gloo", 8), broadcast_tree("mpi", 4), broadcast_tree("mpi", 8)) == \
        ("binomial", "linear", "chain")
    assert inter_multiplier(3) == 3
    assert inter_multiplier(2, 2, hierarchical=True) == 4  # every rank sends its node shard across
    assert inter_multiplier(2, 2, hierarchical=True, leader_only=True) == 2  # PowerSGD: leaders only
    assert inter_multiplier(2, 2, exchange="allreduce") == 2  # flat ring: 2 of its 4 hops cross
    assert inter_multiplier(2, 2, exchange="twophase") is None
    # one rank per host: as it always was (workers · Σ bytes_sent + (workers − 1) · 4 · params)
    assert accounted_bytes([100.0, 100.0], 1000, 3) == 3 * 200 + 2 * 4000
    assert accounted_bytes([100.0] * 3, 1000, 2, 2, multiplier=4) == 4 * 300 + 2 * 4000
    assert accounted_bytes([100.0], 1000, 2, 2, multiplier=None) is None

    c = tb.HostCounters
    before = [c(0, 0, 0, 0, 0), c(0, 0, 0, 0, 0)]
    after = [c(9_000, 10, 0, 9_500, 0), c(3_000, 5, 0, 3_100, 0)]
    summary = {"steps": 2, "params": 1000, "bytes_per_step": 500.0, "inter_bytes_per_step": 100.0,
               "backend": "gloo", "hierarchical": True, "compressor": "onebit:exchange=twophase",
               "exchange": "twophase"}
    r = wire_report(summary, before, after, ranks_per_node=2)
    assert r["accounted_bytes"] == 4 * 2 * 100 + 2 * 4000 == 8800
    assert r["accounted_startup_bytes"] == 8000 and r["accounted_inter_multiplier"] == 4
    assert r["wire_overhead"] == pytest.approx(12_000 / 8800 - 1)
    assert r["wire_bytes_per_step"] == 12_000 / (4 * 2)
    psgd = wire_report({**summary, "compressor": "powersgd:rank=2", "exchange": "allreduce"}, before, after,
                       ranks_per_node=2, inter_per_step=[50.0, 150.0])
    assert psgd["accounted_bytes"] == 2 * 200 + 8000
    flat = wire_report({**summary, "hierarchical": False}, before, after, ranks_per_node=2)
    assert flat["accounted_bytes"] is None and flat["wire_overhead"] is None and flat["wire_bytes"] == 12_000
    one = wire_report(summary, before, after)  # one rank per host: bytes_sent, every rank
    assert one["accounted_bytes"] == 2 * 2 * 500 + 4000 and "accounted_startup_bytes" not in one


@needs_netns
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_hosts_with_two_ranks_each(prefix, corpus, tmp_path):
    """`--netem 2:50mbit --ranks-per-node 2 --hierarchical`: 4 gloo ranks, 2 in each host's
    namespace. The hosts' interfaces carry the inter-node bytes (4 ranks x the allreduce of their
    node shard) and the part of the start-up broadcast that crosses hosts (2 of its tree's 3 edges),
    within 5 %; the intra-host alltoall and allgather (twice as many bytes) stay off the veth."""
    out = tmp_path / "run"
    env = {"GRADZIP_NETEM_PREFIX": prefix, "OMP_NUM_THREADS": "1"}
    p = gradzip("train", "--backend", "gloo", "--netem", "2:50mbit", "--ranks-per-node", "2", "--hierarchical",
                "--compressor", "none", "--model", "bert-tiny", "--vocab-size", "512", "--corpus", str(corpus),
                "--seq-len", "32", "--batch-size", "4", "--steps", "3", "--eval-batches", "0", "--checkpoint-every",
                "0", "--no-progress", "--out", str(out), env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["workers"] == 4 and s["hierarchical"] is True
    assert s["netem"]["hosts"] == 2 and s["netem"]["ranks_per_node"] == 2
    assert s["netem"]["addresses"] == ["198.18.0.1", "198.18.0.2"]
    assert s["accounted_bytes"] == 4 * 3 * s["inter_bytes_per_step"] + 2 * 4 * s["params"]
    assert abs(s["wire_overhead"]) < 0.05, s
    intra = 4 * 3 * (s["bytes_per_step"] - s["inter_bytes_per_step"])  # what the veth would add if it carried it
    assert intra > s["accounted_bytes"] / 2 and s["wire_bytes"] < s["accounted_bytes"] + intra / 4
    assert min(s["wire_bytes_by_host"]) > 0 and ours(prefix) == []  # both hosts sent; the run's testbed is gone


# -- reshape --trace: a link whose rate changes over time -----------------------------------------
def test_trace_rows_and_bad_rows():
    from gradzip.errors import GradzipError
    from gradzip.netem.trace import default_period, parse_trace

    pts = parse_trace("# a link that drops\ntime_s, rate\n0, 10gbit\n30 100mbit 1ms\n60, 10gbit, 0, 0.5\n")
    assert [(p.t, p.shaping.rate_bps) for p in pts] == [(0, 10e9), (30, 100e6), (60, 10e9)]
    assert pts[1].shaping.delay_s == pytest.approx(1e-3) and pts[2].shaping.loss_pct == 0.5
    assert default_period(pts) == 90
    for text, needle in (("5, 1gbit\n", "first row must be at time 0"), ("0, 1gbit\n0, 2gbit\n", "times must increase"),
                         ("0, fast\n", "trace:1"), ("0\n", "expected 'time, rate"), ("", "no rows"),
                         ("0, 1gbit\n-3, 1gbit\n", "seconds >= 0")):
        with pytest.raises(GradzipError, match=needle) as e:
            parse_trace(text)
        assert "\n" not in str(e.value)


def test_trace_playback_applies_each_row_at_its_time_and_logs_it(tmp_path):
    from gradzip.netem.trace import parse_trace, play

    now = [0.0]
    applied: list[tuple[float, float]] = []

    def sleep(s: float) -> None:
        now[0] += s

    pts = parse_trace("0, 10gbit\n30, 100mbit\n")
    log = tmp_path / "link.jsonl"
    n = play(pts, lambda sh: applied.append((now[0], sh.rate_bps)), log, clock=lambda: now[0], sleep=sleep)
    assert n == 2 and applied == [(0.0, 10e9), (30.0, 100e6)]
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(r["t"], r["rate_bps"]) for r in rows] == [(0.0, 10e9), (30.0, 100e6)]
    # --repeat: passes of --period seconds, until the apply callback stops it (here: 5 changes)
    applied.clear()
    now[0] = 0.0

    class Enough(Exception):
        pass

    def apply(sh):
        if len(applied) == 5:
            raise Enough
        applied.append((now[0], sh.rate_bps))

    with pytest.raises(Enough):
        play(pts, apply, repeat=True, period=60, clock=lambda: now[0], sleep=sleep)
    assert [t for t, _ in applied] == [0, 30, 60, 90, 120]


@needs_netns
@pytest.mark.timeout(120)
def test_reshape_trace_reshapes_the_running_testbed(prefix, tmp_path):
    tb.up(2, Shaping(100e6), prefix=prefix)
    try:
        trace = tmp_path / "link.txt"
        trace.write_text("0, 40mbit\n1, 20mbit\n")
        p = gradzip("netem", "reshape", "--prefix", prefix, "--trace", str(trace), "--log", str(tmp_path / "l.jsonl"))
        assert p.returncode == 0, p.stderr
        assert "played 2 change(s)" in p.stdout
        assert tb.status(prefix)["shaping"]["rate_bps"] == 20e6
        rows = [json.loads(x) for x in (tmp_path / "l.jsonl").read_text().splitlines()]
        assert [r["rate_bps"] for r in rows] == [40e6, 20e6] and rows[1]["t"] >= 1.0
        bad = gradzip("netem", "reshape", "--prefix", prefix, "--rate", "1gbit", "--trace", str(trace))
        assert bad.returncode == 2 and "give --rate (one change) or --trace FILE" in bad.stderr
    finally:
        tb.down(prefix)


# -- unshaped links; gradzip train --netem-trace ----------------------------------------------------
def test_unshaped_spelling():
    from gradzip.errors import GradzipError
    from gradzip.netem.spec import parse_netem, parse_rate
    from gradzip.netem.trace import parse_trace

    s = parse_netem("2:unshaped")
    assert s.shaping == Shaping(None) and s.shaping.unshaped and s.shaping.describe() == "unshaped"
    assert parse_rate("Unshaped") is None and parse_rate("1gbit") == 1e9
    assert [p.shaping.rate_bps for p in parse_trace("0, unshaped\n5, 1gbit\n")] == [None, 1e9]
    for bad in ("2:unshaped:1ms", "2:unshaped:0:1"):
        with pytest.raises(GradzipError, match="unshaped link takes no delay or loss"):
            parse_netem(bad)
    from gradzip.experiments.spec import netem_for_cell
    from gradzip.plots.results import Run
    from gradzip.training.config import TrainConfig

    cell = netem_for_cell({"backend": "gloo", "workers": 2, "bandwidth": "unshaped"})
    assert cell["netem"] == "2:unshaped" and TrainConfig.from_dict(cell).bandwidth == "unshaped"
    assert Run(Path("x"), "x", {"bandwidth": "unshaped"}, None, []).bandwidth_bps is None  # no rate to plot


def test_trace_resolution_shipped_and_relative(tmp_path, monkeypatch):
    from gradzip.errors import GradzipError
    from gradzip.netem.trace import SHIPPED, default_period, read_trace, resolve_trace

    shipped = SHIPPED / "10gbit-100mbit-30s.txt"
    assert resolve_trace("10gbit-100mbit-30s") == resolve_trace("10gbit-100mbit-30s.txt") == shipped
    pts = read_trace(shipped)
    assert [(p.t, p.shaping.rate_bps) for p in pts] == [(0, 10e9), (30, 100e6)] and default_period(pts) == 60
    (tmp_path / "10gbit-100mbit-30s.txt").write_text("0, 1gbit\n")  # a file of that name wins over the shipped one
    monkeypatch.chdir(tmp_path)
    assert resolve_trace("10gbit-100mbit-30s.txt") == Path("10gbit-100mbit-30s.txt")
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "mine.txt").write_text("0, 1gbit\n")
    assert resolve_trace("mine.txt", base=tmp_path / "specs") == tmp_path / "specs" / "mine.txt"
    with pytest.raises(GradzipError, match=r"--netem-trace sub/x.txt: no such file \(relative to .*specs\), nor a "
                       r"shipped trace of that name; shipped: 10gbit-100mbit-30s"):
        resolve_trace("sub/x.txt", base=tmp_path / "specs", flag="--netem-trace")


def test_sweep_spec_reads_a_relative_trace_from_its_directory(tmp_path):
    from gradzip.errors import SpecError
    from gradzip.experiments.spec import load_spec

    (tmp_path / "link.txt").write_text("0, 1gbit\n2, 100mbit\n")
    spec = tmp_path / "s.toml"
    spec.write_text('[base]\nbackend = "gloo"\nworkers = 2\nnetem_trace = "link.txt"\n'
                    '[grid]\nbandwidth = ["1gbit", "unshaped"]\n')
    cells = load_spec(spec).cells
    assert [c.config["netem"] for c in cells] == ["2:1gbit", "2:unshaped"]
    assert all(c.config["netem_trace"] == str(tmp_path / "link.txt") for c in cells)
    spec.write_text('[base]\nbackend = "gloo"\nworkers = 2\nnetem_trace = "gone.txt"\n[grid]\nbandwidth = ["1gbit"]\n')
    with pytest.raises(SpecError, match="--netem-trace gone.txt: no such file"):
        load_spec(spec)
    spec.write_text('[base]\nbackend = "gloo"\nnetem_trace = "link.txt"\n[grid]\nseed = [0]\n')  # no bandwidth
    with pytest.raises(SpecError, match="needs --netem"):
        load_spec(spec)


def test_playback_thread_repeats_until_the_block_ends_and_the_run_log_waits_for_the_run(tmp_path):
    from gradzip.netem.trace import Playback, parse_trace
    from gradzip.training.launch import RunLinkLog

    out = tmp_path / "run"
    log = RunLinkLog(out)
    applied: list[float | None] = []
    with Playback(parse_trace("0, 1gbit\n0.05, unshaped\n"), lambda sh: applied.append(sh.rate_bps), log) as pb:
        time.sleep(0.33)  # period 0.1 s: about 7 changes
        assert log.pending and not out.exists()  # held back: --out must stay empty until the ranks take it
        out.mkdir()
        (out / "config.toml").write_text("steps = 3\n")
        (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')  # a torn last line
        time.sleep(0.25)
    n = len(applied)
    time.sleep(0.15)
    assert len(applied) == n >= 5 and pb.error is None and applied[:3] == [1e9, None, 1e9]  # stopped for good
    rows = [json.loads(x) for x in (out / "link.jsonl").read_text().splitlines()]
    assert len(rows) == n and rows[0]["step"] == 0 and rows[-1]["step"] == 2
    assert [r["rate"] for r in rows[:2]] == ["1gbit", "unshaped"] and rows[1]["rate_bps"] is None
    assert {"t", "unix", "rate_bps", "delay_s", "loss_pct", "applied_s"} <= set(rows[0])


def test_policy_figure_reads_the_run_directory_link_log(tmp_path):
    from gradzip.plots.policy import load_link
    from gradzip.plots.results import Run

    (tmp_path / "link.jsonl").write_text('{"step": 0, "rate_bps": 1e10}\n{"t": 3, "rate_bps": 1e8}\n'
                                         '{"step": 40, "rate_bps": 1e8}\nnot json\n{"step": 90, "rate_bps": null}\n')
    assert load_link(Run(tmp_path, "x", {}, None, [])) == [(0, 1e10), (40, 1e8)]


@needs_netns
@pytest.mark.timeout(120)
def test_train_with_a_netem_trace_logs_the_link_and_restores_the_testbed(prefix, corpus, tmp_path):
    """`gradzip train --netem 2:10gbit --netem-trace` in a testbed that was up at 10 Gbit/s: the trace
    (10 Gbit/s, then unshaped after 1 s) is played while the run goes on, link.jsonl records it, and
    the testbed is back at 10 Gbit/s afterwards."""
    tb.up(2, Shaping(10e9), prefix=prefix)
    trace, out = tmp_path / "link.txt", tmp_path / "run"
    trace.write_text("0, 10gbit\n1, unshaped\n60, 1gbit\n")  # the run ends long before the third row
    env = {"GRADZIP_NETEM_PREFIX": prefix, "OMP_NUM_THREADS": "1"}
    p = gradzip("train", "--backend", "gloo", "--netem", "2:10gbit", "--netem-trace", str(trace), "--model",
                "bert-tiny", "--vocab-size", "512", "--corpus", str(corpus), "--seq-len", "32", "--batch-size", "4",
                "--steps", "3", "--eval-batches", "0", "--checkpoint-every", "0", "--no-progress", "--out", str(out),
                env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "link.jsonl").read_text().splitlines()]
    assert [r["rate_bps"] for r in rows] == [10e9, None] and rows[1]["t"] >= 1.0, rows
    assert all(0 <= r["step"] <= 3 for r in rows) and rows[0]["unix"] < rows[1]["unix"]
    s = json.loads((out / "summary.json").read_text())
    assert s["netem"]["trace"] == str(trace) and s["netem"]["testbed"] == "existing" and s["netem"]["rate_bps"] == 10e9
    assert s["wire_bytes"] > 0 and s["wire_frame_bytes"] is None  # the qdiscs' counters restarted at each change
    after = tb.load(prefix)
    assert after is not None and after.shaping == Shaping(10e9)
    cls = subprocess.run([tb.tool("tc"), "-n", f"{prefix}-h0", "class", "show", "dev", "eth0"], capture_output=True,
                         text=True).stdout
    assert "rate 10Gbit" in cls  # htb back in place of the unshaped pfifo_fast
