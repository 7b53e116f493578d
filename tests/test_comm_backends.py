"""Real backends in several processes on CPU (Gloo 2 and 4 ranks; ``mpirun -n 2`` and ``-n 4``),
checked against the ``sim`` backend as the reference, plus failure handling, launcher
environments and ``spawn_local``.

Each backend test is one launch of ``gradzip.testing.comm_selftest`` (the battery of collectives of
``gradzip.testing.comm_battery``: allreduce of fp32/fp16/bf16/fp64/int/uint8/bool with sum and mean,
allgather of per-rank shapes including uint8 and empty tensors, broadcast, alltoall of many dtypes
and shapes (and its ValueError for a first dimension the world size does not divide), split into
sub-communicators and a split of a split with every op inside, several outstanding async ops, byte
accounting, ``same_shape`` allgathers of many dtypes with their launch properties: one collective
and no header exchange, counted at the library calls; no blocking at launch while a peer is late;
waits in different orders without deadlock), followed by a failure phase in which one rank dies or
hangs and the others must raise a CommError that names it. The 4-rank launches run the failing
collective on a sub-communicator, whose errors name global ranks; the failing collective is an
allreduce, a variable-size allgather (Gloo, 2 ranks) or a ``same_shape`` allgather (4 ranks). A hung
launch is stopped by spawn_local's timeout (and pytest-timeout), so it fails the test.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import mpi_unavailable

from gradzip.comm import detect_launcher_env, expand_nodelist, init_communicator, spawn_local
from gradzip.errors import GradzipError
from gradzip.testing.comm_battery import same_shape_input
from gradzip.testing.comm_selftest import compare, self_check, sim_reference

FAIL_TIMEOUT = 3.0  # the collective timeout in the failure phase
LAUNCH_TIMEOUT = 120.0  # a launch that takes longer is stopped (a hang), failing the test




# Tests that start no process keep the module timeout; those that do have a tighter one of their own.
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]
needs_mpi = pytest.mark.skipif(mpi_unavailable() is not None, reason=str(mpi_unavailable()))


@functools.cache
def _reference(n: int) -> list[dict[str, torch.Tensor]]:
    return sim_reference(n)


def _launch(backend: str, n: int, fail: str, out: Path, fail_on: str = "world",
            fail_op: str = "allreduce") -> tuple[int, dict[int, dict], dict[int, dict]]:
    argv = ["--backend", backend, "--timeout", "60", "--out", str(out), "--fail", fail,
            "--fail-timeout", str(FAIL_TIMEOUT), "--fail-on", fail_on, "--fail-op", fail_op]
    rc = spawn_local(backend, n, argv, env_extra={"OMP_NUM_THREADS": "1"}, timeout=LAUNCH_TIMEOUT,
                     module="gradzip.testing.comm_selftest", grace=8.0)
    pts, jsons = {r: out / f"rank{r}.pt" for r in range(n)}, {r: out / f"rank{r}.json" for r in range(n)}
    results = {r: torch.load(p, weights_only=True) for r, p in pts.items() if p.exists()}
    reports = {r: json.loads(p.read_text()) for r, p in jsons.items() if p.exists()}
    return rc, results, reports


def _check_battery(results: dict[int, dict], n: int) -> None:
    assert sorted(results) == list(range(n)), f"missing results from ranks {set(range(n)) - set(results)}"
    ref = _reference(n)
    for r in range(n):
        problems = self_check(results[r], r, n)  # alltoall and split, against directly computed values
        assert not problems, f"rank {r}:\n" + "\n".join(problems)
        problems = compare(results[r], ref[r])
        assert not problems, f"rank {r} differs from sim:\n" + "\n".join(problems)
        assert results[r]["alltoall/bad_input"].all()  # ValueError naming the rule, ranks still in step
        assert results[r]["stats/alltoall"][0] > 0 and results[r]["stats/split"][0] == 3
        # independent spot checks (not through sim)
        for k in range(n):
            assert torch.equal(results[r][f"allgather/i32/{k}"], torch.arange(7 + k, dtype=torch.int32) * (k + 1))
            assert results[r][f"allgather/u8/{k}"].shape == (5 * k,)
            assert results[r][f"allgather/scalar/{k}"].shape == () and results[r][f"allgather/scalar/{k}"] == k
        assert torch.equal(results[r]["broadcast/f32"], results[0]["broadcast/f32"])
        key = "allreduce/torch.float32/sum/1003"
        assert torch.equal(results[r][key], results[0][key])  # every rank ends with the same sum
        # same_shape: one data collective and no header exchange, on the world and in a split;
        # the variable form launches only its header at issue; neither blocks while rank 0 is late
        for where in ("world", "split"):
            assert results[r][f"launch/{where}/same_calls"].tolist() == [1, 0], (r, where)
            assert results[r][f"launch/{where}/var_calls_ok"], (r, where)
        assert results[r]["launch/nonblocking"], f"rank {r}: an allgather blocked at launch"
        for k in range(n):  # independent of sim: rank k's input, whatever the dtype
            for dt in (torch.bfloat16, torch.complex64, torch.bool):
                assert torch.equal(results[r][f"same/{dt}/{k}"], same_shape_input(dt, (3, 5), k)), (r, k, dt)


def _check_named(reports: dict[int, dict], ranks: list[int], pattern: str, sub: bool = False,
                 op: str = "allreduce") -> None:
    assert sorted(reports) == ranks, f"failure reports from {sorted(reports)}, expected {ranks}"
    n = len(ranks) + 2 if sub else None  # the sub-communicator of the 4-rank tests: every rank, reversed
    for r, rep in reports.items():
        assert rep["is_comm_error"], f"rank {r}: {rep}"
        where = f"on global rank {r} (rank {n - 1 - r} of the sub-communicator of global ranks " \
                f"{list(range(n))[::-1]})" if sub else f"on rank {r}"
        assert op in rep["message"] and where in rep["message"], f"rank {r}: {rep['message']}"
        assert re.search(pattern, rep["message"]), f"rank {r}: {rep['message']}"
        # bounded by the configured timeout (+ the 2 s diagnosis), far from the 60 s init timeout
        assert rep["seconds"] < FAIL_TIMEOUT + 20


@pytest.mark.timeout(180)
def test_gloo_2_ranks_and_peer_death(tmp_path):
    """The failing collective is a variable-size allgather: its deferred launch reports the loss."""
    rc, results, reports = _launch("gloo", 2, "die:1", tmp_path, fail_op="allgather")
    _check_battery(results, 2)
    assert rc != 0  # rank 1 died
    _check_named(reports, [0], r"lost rank\(s\) \[1\]", op="allgather")


@pytest.mark.timeout(180)
def test_gloo_rank_0_death_is_one_line_without_cpp_frames(tmp_path, capfd):
    """Rank 0 hosts the rendezvous store: when it dies, the survivor names it, and torch's C++
    warnings (c10d "sendBytes failed" with a stack of frames) stay off the terminal."""
    rc, _, reports = _launch("gloo", 2, "die:0", tmp_path)
    assert rc != 0
    _check_named(reports, [1], r"lost rank 0")
    err = capfd.readouterr().err
    assert "frame #" not in err and "Exception raised from" not in err, err[-3000:]


@pytest.mark.timeout(180)
def test_gloo_4_ranks_hung_and_late_peers(tmp_path):
    """The failing collective (a same_shape allgather) runs on a sub-communicator (every rank,
    reversed), so the hung and the late rank must be named by their global ranks."""
    rc, results, reports = _launch("gloo", 4, "stall:2,behind:3", tmp_path, fail_on="split", fail_op="allgather_same")
    _check_battery(results, 4)
    assert rc == 3  # the survivors' code after their CommTimeout
    _check_named(reports, [0, 1], r"lost global rank\(s\) \[2\]", sub=True, op="allgather")
    for rep in reports.values():
        assert rep["error"] == "CommTimeout" and f"timed out after {FAIL_TIMEOUT:g} s" in rep["message"]
        assert re.search(r"global rank 3 \(last launched #\d+\)", rep["message"])


@needs_mpi
@pytest.mark.timeout(180)
def test_mpi_2_ranks_and_peer_death(tmp_path, capfd):
    rc, results, _ = _launch("mpi", 2, "die:1", tmp_path)
    _check_battery(results, 2)
    # Open MPI's runtime ends the whole job when a rank exits, and mpirun names the rank.
    assert rc != 0
    err = capfd.readouterr().err
    assert re.search(r"Process name: \[[^\]]*,1\]", err), err[-2000:]


@needs_mpi
@pytest.mark.timeout(180)
def test_mpi_4_ranks_hung_and_late_peers(tmp_path):
    """As the Gloo test: the failure (a same_shape allgather) is on a sub-communicator, named by
    global ranks."""
    rc, results, reports = _launch("mpi", 4, "stall:2,behind:3", tmp_path, fail_on="split", fail_op="allgather_same")
    _check_battery(results, 4)
    assert rc == 3
    _check_named(reports, [0, 1], r"global rank\(s\) \[2\] not responding", sub=True, op="allgather")
    for rep in reports.values():
        assert rep["error"] == "CommTimeout"
        assert re.search(r"rank 3 \(last launched #\d+, waiting in #\d+\)", rep["message"]) is None
        assert re.search(r"global rank 3 \(last launched #\d+\)", rep["message"])


# ---------------------------------------------------------------- spawn_local with a tiny probe

PROBE = textwrap.dedent("""
    import json, os, signal, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    rank = os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
    def mark(name, code):
        open(os.path.join(out, name + rank), "w").close()
        sys.exit(code)
    signal.signal(signal.SIGTERM, lambda *a: mark("term", 143))
    signal.signal(signal.SIGINT, lambda *a: mark("int", 130))
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "OMP_NUM_THREADS", "GZ_EXTRA", "GZ_PREFIX", "OMPI_COMM_WORLD_RANK", "GRADZIP_LAUNCHER"]
    with open(os.path.join(out, "env" + rank + ".json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
    if mode == "ok":
        sys.exit(0)
    if mode == "fail1" and rank == "1":
        sys.exit(5)
    time.sleep(60)
""")


@pytest.fixture
def probe(tmp_path, monkeypatch):
    (tmp_path / "gzprobe.py").write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return tmp_path, out


def _env(out: Path, r: int) -> dict:
    return json.loads((out / f"env{r}.json").read_text())


@pytest.mark.timeout(60)
def test_spawn_local_sets_rank_env_and_prefix(probe):
    tmp, out = probe
    rc = spawn_local("gloo", 3, [str(out), "ok"], env_extra={"PYTHONPATH": str(tmp), "GZ_EXTRA": "x"},
                     module="gzprobe", prefix=lambda r: ["env", f"GZ_PREFIX=p{r}"], timeout=30)
    assert rc == 0
    envs = [_env(out, r) for r in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] == [e["LOCAL_RANK"] for e in envs]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"} and {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and int(envs[0]["MASTER_PORT"]) > 0
    assert [e["GZ_PREFIX"] for e in envs] == ["p0", "p1", "p2"]
    assert all(e["OMP_NUM_THREADS"] == "1" and e["GZ_EXTRA"] == "x" for e in envs)
    # an OMP_NUM_THREADS that is set is kept
    rc = spawn_local("gloo", 1, [str(out), "ok"], env_extra={"PYTHONPATH": str(tmp), "OMP_NUM_THREADS": "3"},
                     module="gzprobe", timeout=30)
    assert rc == 0 and _env(out, 0)["OMP_NUM_THREADS"] == "3"


@pytest.mark.timeout(60)
def test_spawn_local_failure_stops_the_others(probe):
    tmp, out = probe
    rc = spawn_local("gloo", 2, [str(out), "fail1"], env_extra={"PYTHONPATH": str(tmp)}, module="gzprobe",
                     timeout=50, grace=0.5)
    assert rc == 5  # the failing rank's code
    assert (out / "term0").exists()  # rank 0 was asked to stop (SIGTERM), not left running


@pytest.mark.timeout(60)
def test_spawn_local_timeout(probe):
    tmp, out = probe
    rc = spawn_local("gloo", 2, [str(out), "sleep"], env_extra={"PYTHONPATH": str(tmp)}, module="gzprobe",
                     timeout=1.0)
    assert rc == 124
    assert (out / "term0").exists() and (out / "term1").exists()


@pytest.mark.timeout(90)
def test_spawn_local_forwards_ctrl_c(probe):
    tmp, out = probe
    code = ("import sys; from gradzip.comm.launch import spawn_local; "
            f"sys.exit(spawn_local('gloo', 2, [{str(out)!r}, 'sleep'], env_extra={{'PYTHONPATH': {str(tmp)!r}}}, "
            "module='gzprobe', timeout=60, grace=10))")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while not ((out / "env0.json").exists() and (out / "env1.json").exists()):
            assert time.monotonic() < deadline and parent.poll() is None, "workers did not start"
            time.sleep(0.05)
        parent.send_signal(signal.SIGINT)
        assert parent.wait(timeout=30) == 130
    finally:
        if parent.poll() is None:
            parent.kill()
    assert (out / "int0").exists() and (out / "int1").exists()


@needs_mpi
@pytest.mark.timeout(90)
def test_spawn_local_mpi_with_prefix(probe):
    tmp, out = probe
    rc = spawn_local("mpi", 2, [str(out), "ok"], env_extra={"PYTHONPATH": str(tmp), "GZ_EXTRA": "y"},
                     module="gzprobe", prefix=lambda r: ["env", f"GZ_PREFIX=m{r}"], timeout=60)
    assert rc == 0
    envs = [_env(out, r) for r in range(2)]
    assert [e["OMPI_COMM_WORLD_RANK"] for e in envs] == ["0", "1"]
    assert [e["GZ_PREFIX"] for e in envs] == ["m0", "m1"]
    assert all(e["GZ_EXTRA"] == "y" and e["OMP_NUM_THREADS"] == "1" and e["RANK"] is None for e in envs)


def test_spawn_local_bad_input():
    with pytest.raises(GradzipError, match="workers"):
        spawn_local("gloo", 0, [])
    with pytest.raises(GradzipError, match="unknown backend"):
        spawn_local("carrier-pigeon", 2, [])
    with pytest.raises(GradzipError, match="bind_addrs"):
        spawn_local("gloo", 2, [], bind_addrs=["10.0.0.1"])


# ---------------------------------------------------------------- launcher environments

def test_detect_torchrun():
    e = detect_launcher_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h0",
                             "MASTER_PORT": "29400", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.launcher) == \
        (3, 8, 1, "h0", 29400, "torchrun")
    assert e.external and e.local_world_size == 2


def test_detect_open_mpi():
    base = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "PMIX_NAMESPACE": "prterun-host-123@1"}
    one_host = detect_launcher_env(dict(base, OMPI_COMM_WORLD_LOCAL_SIZE="4"))
    assert (one_host.rank, one_host.world_size, one_host.local_rank, one_host.launcher) == (2, 4, 2, "mpirun")
    assert one_host.master_addr == "127.0.0.1"
    # every rank derives the same port from the job's namespace; another job gets another port
    other_rank = detect_launcher_env(dict(base, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_LOCAL_SIZE="4"))
    assert one_host.master_port == other_rank.master_port and 20000 <= one_host.master_port < 40000
    other_job = detect_launcher_env(dict(base, OMPI_COMM_WORLD_LOCAL_SIZE="4", PMIX_NAMESPACE="prterun-host-9@1"))
    assert other_job.master_port != one_host.master_port
    two_hosts = detect_launcher_env(dict(base, OMPI_COMM_WORLD_LOCAL_SIZE="2"))
    assert two_hosts.master_addr is None  # init_communicator asks rank 0 over MPI
    explicit = detect_launcher_env(dict(base, MASTER_ADDR="10.1.1.1", MASTER_PORT="1234"))
    assert (explicit.master_addr, explicit.master_port) == ("10.1.1.1", 1234)


def test_detect_mpich_pmi():
    e = detect_launcher_env({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.launcher) == (1, 2, 1, "127.0.0.1", "mpirun")


def test_detect_slurm():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242",
           "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[07-08,11],login1"}
    e = detect_launcher_env(env)
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.launcher) == (5, 8, 1, "gpu07", "slurm")
    assert e.master_port == detect_launcher_env(dict(env, SLURM_PROCID="0")).master_port
    assert detect_launcher_env(dict(env, SLURM_STEP_NODELIST="n[3-4]")).master_addr == "n3"
    assert detect_launcher_env(dict(env, MASTER_ADDR="head")).master_addr == "head"
    assert detect_launcher_env(dict(env, SLURM_STEP_NUM_TASKS="6")).world_size == 6  # the step's, not the job's


def test_detect_nothing():
    e = detect_launcher_env({})
    assert (e.rank, e.world_size, e.launcher, e.external) == (0, 1, "none", False)
    with pytest.raises(GradzipError, match="RANK"):
        detect_launcher_env({"RANK": "x", "WORLD_SIZE": "2"})


@pytest.mark.parametrize("text, hosts", [
    ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
    ("a1", ["a1"]),
    ("c[8-11]", ["c8", "c9", "c10", "c11"]),
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
    ("x[009-010]-ib,y", ["x009-ib", "x010-ib", "y"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("bad", ["node[01-04", "node[4-1]", "n[1-2]]", "n[a-b]", ""])
def test_expand_nodelist_malformed(bad):
    with pytest.raises(GradzipError):
        expand_nodelist(bad)


def test_init_communicator_bad_input():
    with pytest.raises(GradzipError, match="unknown backend"):
        init_communicator("infiniband")
    with pytest.raises(GradzipError, match="SimWorld"):
        init_communicator("sim")
    with pytest.raises(GradzipError, match="timeout"):
        init_communicator("gloo", timeout=0)


def test_importing_comm_does_not_need_mpi4py():
    code = ("import sys; sys.modules['mpi4py'] = None; import gradzip.comm as c; "
            "assert c.init_communicator and c.SimWorld; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
