"""Run the ranks of ``gradzip train`` inside the network testbed, one rank per emulated host.

``gradzip train --backend gloo --netem 4:100mbit`` (spelling ``HOSTS:RATE[:DELAY[:LOSS%]]``, e.g.
``4:1gbit:0.1ms:0.01``) runs HOSTS ranks; rank i runs in namespace ``gz-hI`` (via ``ip netns exec``)
and binds to its address 198.18.0.(i+1); the rendezvous (MASTER_ADDR) is host 0's address. With
``--backend mpi`` the same happens under ``mpirun`` (TCP only, restricted to the testbed
addresses). ``--workers`` is ignored: the world size is HOSTS. In a sweep, a ``gloo``/``mpi`` cell
that sets ``bandwidth`` runs as ``--netem WORKERS:BANDWIDTH``
(:func:`gradzip.experiments.sweep.netem_for_cell`).

The testbed (prefix ``GRADZIP_NETEM_PREFIX``, default ``gz``):

- not up: built for the run and removed afterwards (also on failure or Ctrl-C);
- up with at least HOSTS hosts: used as is, or reshaped for the run and restored afterwards.

Wire bytes: before and after the run, each host's ``tx_bytes`` are read; ``summary.json`` gets

- ``wire_bytes``: bytes all ranks' interfaces transmitted during the run (L2 frames: payload,
  TCP/IP/Ethernet headers, ACKs, rendezvous, the start-up broadcast and bookkeeping; veth passes
  GSO super-packets, so headers count once per up-to-64 KB packet);
- ``wire_frame_bytes``: the same traffic as the shapers counted it, headers once per MTU-sized
  segment (what a real Ethernet link with TSO carries, less preamble and FCS);
- ``accounted_bytes``: what the communication layer accounts for the same run, summed over ranks:
  ``workers · Σ_steps bytes_sent`` (bytes_sent: rank 0's, as in metrics.jsonl) plus the start-up
  broadcast of the fp32 parameters, ``(workers − 1) · 4 · params``;
- ``wire_overhead = wire_bytes / accounted_bytes − 1``;
- ``wire_bytes_per_step = wire_bytes / (workers · steps)``: per rank per step, the unit of
  ``bytes_per_step`` (start-up traffic amortised over the steps of this run).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gradzip.comm.launch import find_mpirun, spawn_local, supervise
from gradzip.errors import GradzipError
from gradzip.netem import testbed
from gradzip.netem.spec import NetemSpec, parse_netem
from gradzip.netem.testbed import Testbed
from gradzip.training.config import TrainConfig
from gradzip.training.metrics import read_metrics, update_summary


def default_prefix() -> str:
    return testbed.validate_prefix(os.environ.get("GRADZIP_NETEM_PREFIX", testbed.DEFAULT_PREFIX))


@contextlib.contextmanager
def testbed_for(spec: NetemSpec, prefix: str | None = None) -> Iterator[tuple[Testbed, str]]:
    """The testbed for a run: ``(testbed, how)`` with how ``created``/``existing``/``reshaped``.
    Whatever this created or changed is undone on exit, whatever the exit."""
    prefix = prefix or default_prefix()
    testbed.check_privileges()
    old = testbed.load(prefix)
    existing = testbed.owned_namespaces(prefix, testbed.list_namespaces())
    if old is not None and sorted(existing) == sorted(old.namespaces()):
        if old.hosts < spec.hosts:
            raise GradzipError(f"testbed {prefix!r} is up with {old.hosts} hosts but --netem asks for {spec.hosts}; "
                               f"`gradzip netem down` it first, or use at most {old.hosts} hosts")
        if old.shaping == spec.shaping:
            yield old, "existing"
            return
        tb = testbed.reshape(prefix, spec.shaping)
        try:
            yield tb, "reshaped"
        finally:
            with testbed.signals_ignored():
                testbed.reshape(prefix, old.shaping)
        return
    tb, _ = testbed.up(spec.hosts, spec.shaping, prefix)
    try:
        yield tb, "created"
    finally:
        with testbed.signals_ignored():
            testbed.down(prefix)


def launch_in_testbed(cfg: TrainConfig, argv: list[str], env_extra: dict[str, str] | None = None) -> int:
    """The ``gradzip train --netem`` hook: start one rank per host of the testbed, wait, then add the
    wire-byte report to ``cfg.out/summary.json``. Returns the ranks' exit code."""
    spec = parse_netem(cfg.netem)
    if cfg.backend not in ("gloo", "mpi"):
        raise GradzipError(f"--netem needs --backend gloo or mpi, not {cfg.backend!r}")
    n = spec.hosts
    env = dict(env_extra or {})
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // n))
    ip = testbed.tool("ip")
    with testbed_for(spec) as (tb, how):
        addrs = [tb.host_addr(i) for i in range(n)]
        sys.stderr.write(f"gradzip train: {n} {cfg.backend} ranks in testbed {tb.prefix} ({how}): "
                         f"{addrs[0]}..{addrs[-1]}, egress {spec.shaping.describe()} per host\n")
        first_step = _metrics_step_count(cfg.out)  # a resumed run: count only this invocation's steps
        before = testbed.counters(tb, n)
        if cfg.backend == "mpi":
            rc = spawn_mpi(tb, n, argv, env)
        else:
            rc = spawn_local(cfg.backend, n, argv, env_extra=env, bind_addrs=addrs,
                             prefix=lambda r: [ip, "netns", "exec", tb.host_ns(r)])
        after = testbed.counters(tb, n)
    if rc == 0 and cfg.out and (Path(cfg.out) / "summary.json").is_file():
        s = add_wire_report(Path(cfg.out), spec, tb, how, before, after, first_step)
        if s.get("wire_overhead") is not None:
            sys.stderr.write(f"gradzip train: on the wire {s['wire_bytes']:,} bytes from {n} hosts, "
                             f"{s['wire_overhead']:+.2%} vs the {s['accounted_bytes']:,} bytes accounted "
                             f"({s['wire_frame_overhead']:+.2%} counting every frame's headers)\n")
    return rc


def spawn_mpi(tb: Testbed, n: int, argv: list[str], env_extra: dict[str, str], timeout: float | None = None,
              module: str = "gradzip") -> int:
    """``python -m mpi4py -m <module> <argv>`` as n MPI ranks, rank i in host i's namespace.

    A per-rank ``ip netns exec`` wrapper under an ordinary mpirun does not work: each rank talks to
    its local PMIx server over TCP loopback, which does not cross namespaces. So mpirun runs inside
    host 0's namespace with a hostfile of the testbed's addresses, and its remote-shell agent (the
    ``ssh`` it would use between machines) is a script that starts each host's daemon with
    ``ip netns exec``. MPI is restricted to TCP on the testbed subnet; the collectives that use
    shared memory between ranks on one machine (han, xhc, acoll, sm) are off, since the ranks here
    only look local (same hostname)."""
    ip, mpirun = testbed.tool("ip"), find_mpirun()
    env = dict(os.environ, **env_extra)
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="gradzip-netem-mpi-") as tmp:
        agent, hostfile = Path(tmp) / "agent.sh", Path(tmp) / "hosts"
        cases = "".join(f"  {tb.host_addr(i)}) ns={tb.host_ns(i)} ;;\n" for i in range(n))
        agent.write_text("#!/bin/sh\n# gradzip netem: mpirun's remote shell = enter the host's namespace\n"
                         f"host=\"$1\"; shift\ncase \"$host\" in\n{cases}"
                         "  *) echo \"gradzip netem agent: unknown host $host\" >&2; exit 1 ;;\nesac\n"
                         f"exec {shlex.quote(ip)} netns exec \"$ns\" /bin/sh -c \"$*\"\n")
        agent.chmod(0o755)
        hostfile.write_text("".join(f"{tb.host_addr(i)} slots=1\n" for i in range(n)))
        cmd = [ip, "netns", "exec", tb.host_ns(0), mpirun, "-n", str(n), "--hostfile", str(hostfile),
               "--prtemca", "plm_ssh_agent", str(agent), "--prtemca", "oob_tcp_if_include", tb.subnet,
               "--mca", "oob_tcp_if_include", tb.subnet, "--mca", "btl", "self,tcp", "--mca", "pml", "ob1",
               "--mca", "btl_tcp_if_include", tb.subnet, "--mca", "coll", "^han,xhc,acoll,sm", "--bind-to", "none"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        for k in sorted({*env_extra, "OMP_NUM_THREADS"}):
            cmd += ["-x", k]
        cmd += [sys.executable, "-m", "mpi4py", "-m", module, *argv]
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        return supervise([proc], ["mpirun"], timeout, 10.0)


def _metrics_step_count(out: str | Path | None) -> int:
    """The last step recorded in ``out/metrics.jsonl`` (0 for a new run)."""
    path = Path(out) / "metrics.jsonl" if out else None
    if path is None or not path.is_file():
        return 0
    return max((int(r.get("step", 0)) for r in read_metrics(path)), default=0)


def wire_report(summary: dict[str, Any], before: list[testbed.HostCounters],
                after: list[testbed.HostCounters], sent_per_step: list[float] | None = None) -> dict[str, Any]:
    """The wire-byte fields (see the module docstring) for a run's summary. ``sent_per_step``: the
    engine's ``bytes_sent`` of each step this invocation ran (default: every step of the summary)."""
    n = len(before)
    tx = [a.tx_bytes - b.tx_bytes for a, b in zip(after, before)]
    frames = [a.shaped_bytes - b.shaped_bytes for a, b in zip(after, before)]
    if sent_per_step is None:
        sent_per_step = [float(summary.get("bytes_per_step") or 0.0)] * int(summary.get("steps") or 0)
    steps = len(sent_per_step)
    params = int(summary.get("params") or 0)
    accounted = n * sum(sent_per_step) + (n - 1) * 4 * params
    return {
        "wire_bytes": sum(tx),
        "wire_frame_bytes": sum(frames),
        "wire_bytes_by_host": tx,
        "wire_drops": sum(a.drops - b.drops for a, b in zip(after, before)),
        "accounted_bytes": int(accounted),
        "wire_overhead": (sum(tx) / accounted - 1.0) if accounted > 0 else None,
        "wire_frame_overhead": (sum(frames) / accounted - 1.0) if accounted > 0 else None,
        "wire_bytes_per_step": sum(tx) / (n * steps) if steps else None,
    }


def add_wire_report(out: Path, spec: NetemSpec, tb: Testbed, how: str, before: list[testbed.HostCounters],
                    after: list[testbed.HostCounters], first_step: int = 0) -> dict[str, Any]:
    """Add the wire-byte fields and the testbed's description to ``out/summary.json``."""
    summary = json.loads((out / "summary.json").read_text())
    records = read_metrics(out / "metrics.jsonl")
    sent = [float(r.get("bytes_sent") or 0) for r in records if r.get("step", 0) > first_step]
    extra = wire_report(summary, before, after, sent)
    extra["netem"] = {"spec": spec.text, "hosts": spec.hosts, "prefix": tb.prefix, "testbed": how,
                      "addresses": [tb.host_addr(i) for i in range(spec.hosts)], "mtu": tb.mtu,
                      "loss_method": tb.loss_method, **asdict(spec.shaping)}
    return update_summary(out, extra)
