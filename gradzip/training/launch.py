"""Run the ranks of ``gradzip train`` inside the network testbed: one rank per emulated host, or
``--ranks-per-node K`` ranks per host.

``gradzip train --backend gloo --netem 4:100mbit`` (spelling ``HOSTS:RATE[:DELAY[:LOSS%]]``, e.g.
``4:1gbit:0.1ms:0.01``) runs HOSTS ranks; rank i runs in namespace ``gz-hI`` (via ``ip netns exec``)
and binds to its address 198.18.0.(i+1); the rendezvous (MASTER_ADDR) is host 0's address. With
``--backend mpi`` the same happens under ``mpirun`` (TCP only, restricted to the testbed
addresses). ``--workers`` is ignored: the world size is HOSTS × K (K = ``--ranks-per-node``,
default 1).

Several ranks per host (``--ranks-per-node K``): rank r runs in host ``r // K``'s namespace and
binds to that host's address, with LOCAL_RANK ``r % K``, LOCAL_WORLD_SIZE K and GRADZIP_NODE
``r // K`` (so :mod:`gradzip.comm.topology` makes each host one node). Traffic between ranks of one
host goes over that namespace's loopback, unshaped and uncounted; only traffic between hosts
crosses the shaped veth links. ``mpi``: the hostfile gives every host ``slots=K``, mpirun starts
HOSTS × K ranks mapped by slot (ranks ``hK .. hK+K-1`` on host h) and keeps the TCP BTL (``self,tcp``,
no shared memory) on the testbed subnet, so the ranks of one host talk TCP over its own address.
``OMP_NUM_THREADS``, unless set: ``cpu_count // (HOSTS × K)``, at least 1.

In a sweep, a ``gloo``/``mpi`` cell that sets ``bandwidth`` runs as ``--netem HOSTS:BANDWIDTH``
with HOSTS = ``workers // ranks_per_node`` (:func:`gradzip.experiments.spec.netem_for_cell`).
RATE (and ``bandwidth``) may be ``unshaped``: no rate limit on the links.

A changing link: ``--netem-trace FILE`` (a file of ``time, rate`` rows, or a shipped trace's name;
:mod:`gradzip.netem.trace`) is played on the testbed from the launch of the ranks until they exit
(the trace repeats; :func:`link_trace`), each change appended to ``link.jsonl`` in ``--out`` with
the step the run had reached (:class:`RunLinkLog`). Afterwards the testbed has its rate from
before the run (or is removed, if the run built it).

The testbed (prefix ``GRADZIP_NETEM_PREFIX``, default ``gz``):

- not up: built for the run and removed afterwards (also on failure or Ctrl-C);
- up with at least HOSTS hosts: used as is, or reshaped for the run and restored afterwards.

Wire bytes: before and after the run, each host's ``tx_bytes`` are read; ``summary.json`` gets

- ``wire_bytes``: bytes all hosts' interfaces transmitted during the run (L2 frames: payload,
  TCP/IP/Ethernet headers, ACKs, rendezvous, the start-up broadcast and bookkeeping; veth passes
  GSO super-packets, so headers count once per up-to-64 KB packet);
- ``wire_frame_bytes``: the same traffic as the shapers counted it, headers once per MTU-sized
  segment (what a real Ethernet link with TSO carries, less preamble and FCS);
- ``accounted_bytes``: what the communication layer accounts for the same traffic, summed over
  ranks (:func:`accounted_bytes`). One rank per host: ``workers · Σ_steps bytes_sent``
  (bytes_sent: rank 0's, as in metrics.jsonl) plus the start-up broadcast of the fp32
  parameters, ``(workers − 1) · 4 · params``. K > 1: only the bytes that cross hosts, from rank
  0's ``bytes_inter`` and the part of the start-up broadcast whose tree edges join two hosts;
- ``wire_overhead = wire_bytes / accounted_bytes − 1``;
- ``wire_bytes_per_step = wire_bytes / (workers · steps)``: per rank (of all HOSTS × K) per step,
  the unit of ``bytes_per_step`` (of ``inter_bytes_per_step`` with K > 1; start-up traffic
  amortised over the steps of this run);
- ``netem``: the testbed (spec, hosts, ``ranks_per_node``, addresses, shaping, ...).
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
from gradzip.compress.registry import parse_spec, registry
from gradzip.errors import GradzipError
from gradzip.netem import testbed, trace
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
            try:
                yield old, "existing"
            finally:  # a --netem-trace may have changed it: back to what it was
                now = testbed.load(prefix)
                if now is not None and now.shaping != old.shaping:
                    with testbed.signals_ignored():
                        testbed.reshape(prefix, old.shaping)
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


class RunLinkLog:
    """``link.jsonl`` of a run: each change of a ``--netem-trace`` with ``step``, the steps in the run's
    ``metrics.jsonl`` when it was applied. Held back until rank 0 has written the run's
    ``config.toml`` (every rank has then accepted ``--out``, which must be empty for a fresh run)."""

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.out = Path(out)
        self.pending: list[dict[str, Any]] = []

    def __call__(self, rec: dict[str, Any]) -> None:
        self.pending.append({**rec, "step": _last_step(self.out / "metrics.jsonl")})
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Append what is held back, once the run's directory is in use (``force``: if it exists)."""
        ready = (self.out / "config.toml").is_file() or (force and self.out.is_dir())
        if self.pending and ready:
            with open(self.out / "link.jsonl", "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(r) + "\n" for r in self.pending))
            self.pending.clear()


def _last_step(metrics: Path) -> int:
    """The step of the last complete line of ``metrics`` (0: none yet)."""
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        with contextlib.suppress(ValueError, TypeError, KeyError):
            return int(json.loads(line)["step"])
    return 0


@contextlib.contextmanager
def link_trace(cfg: TrainConfig, prefix: str) -> Iterator[trace.Playback | None]:
    """``--netem-trace``: play the trace on testbed ``prefix`` while the block runs (repeating), with
    each change logged to ``cfg.out/link.jsonl``; nothing without it."""
    if not cfg.netem_trace:
        yield None
        return
    points = trace.read_trace(trace.resolve_trace(cfg.netem_trace, flag="--netem-trace"), flag="--netem-trace")
    log = RunLinkLog(cfg.out or ".")
    playback = trace.Playback(points, lambda sh: testbed.reshape(prefix, sh), log,
                              name=f"--netem-trace {cfg.netem_trace}")
    try:
        with playback:  # its exit stops playback and waits for a change in progress
            yield playback
    finally:
        log.flush(force=True)


def launch_in_testbed(cfg: TrainConfig, argv: list[str], env_extra: dict[str, str] | None = None) -> int:
    """The ``gradzip train --netem`` hook: start ``cfg.ranks_per_node`` ranks (default 1) on each host
    of the testbed, wait, then add the wire-byte report to ``cfg.out/summary.json``. Returns the
    ranks' exit code."""
    spec = parse_netem(cfg.netem)
    if cfg.backend not in ("gloo", "mpi"):
        raise GradzipError(f"--netem needs --backend gloo or mpi, not {cfg.backend!r}")
    hosts, k = spec.hosts, cfg.ranks_per_node or 1
    if k < 1:
        raise GradzipError(f"--ranks-per-node must be >= 1, got {k}")
    world = hosts * k
    env = dict(env_extra or {})
    per_rank = cfg.threads or max(1, (os.cpu_count() or 1) // world)  # a resumed run keeps its count
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(per_rank)
    ip = testbed.tool("ip")
    with testbed_for(spec) as (tb, how):
        addrs = [tb.host_addr(i) for i in range(hosts)]
        per_host = f", {k} per host" if k > 1 else ""
        sys.stderr.write(f"gradzip train: {world} {cfg.backend} ranks{per_host} in testbed {tb.prefix} ({how}): "
                         f"{addrs[0]}..{addrs[-1]}, egress {spec.shaping.describe()} per host"
                         + (f", then as --netem-trace {cfg.netem_trace} says" if cfg.netem_trace else "") + "\n")
        first_step = _metrics_step_count(cfg.out)  # a resumed run: count only this invocation's steps
        before = testbed.counters(tb, hosts)
        with link_trace(cfg, tb.prefix):  # --netem-trace: from the launch until the ranks exit
            if cfg.backend == "mpi":
                rc = spawn_mpi(tb, hosts, argv, env, ranks_per_node=k)
            elif k == 1:
                rc = spawn_local(cfg.backend, hosts, argv, env_extra=env, bind_addrs=addrs,
                                 prefix=lambda r: [ip, "netns", "exec", tb.host_ns(r)])
            else:
                rc = spawn_local(cfg.backend, world, argv, env_extra=env,
                                 bind_addrs=[addrs[r // k] for r in range(world)],
                                 prefix=lambda r: [ip, "netns", "exec", tb.host_ns(r // k)],
                                 rank_env=lambda r: {"LOCAL_RANK": str(r % k), "LOCAL_WORLD_SIZE": str(k),
                                                     "GRADZIP_NODE": str(r // k)})
        after = testbed.counters(tb, hosts)
    if rc == 0 and cfg.out and (Path(cfg.out) / "summary.json").is_file():
        s = add_wire_report(Path(cfg.out), spec, tb, how, before, after, first_step, ranks_per_node=k,
                            netem_trace=cfg.netem_trace)
        if s.get("wire_overhead") is not None:
            what = "bytes accounted" if k == 1 else "inter-host bytes accounted"
            sys.stderr.write(f"gradzip train: on the wire {s['wire_bytes']:,} bytes from {hosts} hosts, "
                             f"{s['wire_overhead']:+.2%} vs the {s['accounted_bytes']:,} {what}"
                             + (f" ({s['wire_frame_overhead']:+.2%} counting every frame's headers)"
                                if s.get("wire_frame_overhead") is not None else "") + "\n")
    return rc


def spawn_mpi(tb: Testbed, n: int, argv: list[str], env_extra: dict[str, str], timeout: float | None = None,
              module: str = "gradzip", *, ranks_per_node: int = 1) -> int:
    """``python -m mpi4py -m <module> <argv>`` as ``n · ranks_per_node`` MPI ranks, ranks
    ``i·K .. i·K+K−1`` in host i's namespace (K = ``ranks_per_node``).

    A per-rank ``ip netns exec`` wrapper under an ordinary mpirun does not work: each rank talks to
    its local PMIx server over TCP loopback, which does not cross namespaces. So mpirun runs inside
    host 0's namespace with a hostfile of the testbed's addresses (``slots=K`` each; mapped by slot
    when K > 1), and its remote-shell agent (the ``ssh`` it would use between machines) is a script
    that starts each host's daemon with ``ip netns exec``. MPI is restricted to TCP on the testbed
    subnet (ranks of one host then talk TCP over that host's address, i.e. its loopback); the
    collectives that use shared memory between ranks on one machine (han, xhc, acoll, sm) are off,
    since the ranks here only look local (same hostname)."""
    k = ranks_per_node
    if k < 1:
        raise GradzipError(f"ranks_per_node must be >= 1, got {k}")
    ip, mpirun = testbed.tool("ip"), find_mpirun()
    env = dict(os.environ, **env_extra)
    env.setdefault("OMP_NUM_THREADS", "1")
    if k > 1:
        env.pop("GRADZIP_NODE", None)  # each rank's node: its host, rank // K (set by the runtime)
    with tempfile.TemporaryDirectory(prefix="gradzip-netem-mpi-") as tmp:
        agent, hostfile = Path(tmp) / "agent.sh", Path(tmp) / "hosts"
        cases = "".join(f"  {tb.host_addr(i)}) ns={tb.host_ns(i)} ;;\n" for i in range(n))
        agent.write_text("#!/bin/sh\n# gradzip netem: mpirun's remote shell = enter the host's namespace\n"
                         f"host=\"$1\"; shift\ncase \"$host\" in\n{cases}"
                         "  *) echo \"gradzip netem agent: unknown host $host\" >&2; exit 1 ;;\nesac\n"
                         f"exec {shlex.quote(ip)} netns exec \"$ns\" /bin/sh -c \"$*\"\n")
        agent.chmod(0o755)
        hostfile.write_text("".join(f"{tb.host_addr(i)} slots={k}\n" for i in range(n)))
        cmd = [ip, "netns", "exec", tb.host_ns(0), mpirun, "-n", str(n * k), "--hostfile", str(hostfile),
               "--prtemca", "plm_ssh_agent", str(agent), "--prtemca", "oob_tcp_if_include", tb.subnet,
               "--mca", "oob_tcp_if_include", tb.subnet, "--mca", "btl", "self,tcp", "--mca", "pml", "ob1",
               "--mca", "btl_tcp_if_include", tb.subnet, "--mca", "coll", "^han,xhc,acoll,sm", "--bind-to", "none"]
        if k > 1:
            cmd += ["--map-by", "slot"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        for key in sorted({*env_extra, "OMP_NUM_THREADS"}):
            cmd += ["-x", key]
        cmd += [sys.executable, "-m", "mpi4py", "-m", module, *argv]
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        return supervise([proc], ["mpirun"], timeout, 10.0)


def _metrics_step_count(out: str | Path | None) -> int:
    """The last step recorded in ``out/metrics.jsonl`` (0 for a new run)."""
    path = Path(out) / "metrics.jsonl" if out else None
    if path is None or not path.is_file():
        return 0
    return max((int(r.get("step", 0)) for r in read_metrics(path)), default=0)


def broadcast_tree(backend: str, world: int) -> str:
    """The tree of the start-up broadcast (root 0) on ``backend`` with ``world`` ranks, for
    :func:`broadcast_crossings`: Gloo's broadcast is a binomial tree; Open MPI's non-blocking one
    (libnbc, behind the ``MPI_Ibcast`` of the mpi backend) is linear up to 4 ranks and, above, a
    chain for messages of 512 KB or more (the parameters travel in runs of up to
    ``--bucket-cap-mb``; a last run under 64 KB would take a binomial tree, a negligible error)."""
    if backend == "mpi":
        return "linear" if world <= 4 else "chain"
    return "binomial"


def broadcast_crossings(world: int, ranks_per_node: int = 1, tree: str = "binomial") -> int:
    """How many edges of a broadcast tree rooted at rank 0 join ranks on different hosts, with
    ``world`` ranks placed in order (rank r on host ``r // ranks_per_node``). Each edge carries the
    whole message once, so ``crossings · S`` of an S-byte broadcast cross hosts.

    Trees: ``binomial`` (Gloo: rank v receives from v minus its highest set bit: 0→1, 0→2, 1→3,
    0→4, ...), ``chain`` (the communication layer's accounting model: rank v from v − 1),
    ``linear`` (the root sends to every rank). Counts, with K = ``ranks_per_node`` and
    hosts = world / K: ``linear`` and ``binomial`` both ``world − K`` = (hosts − 1)·K (every rank
    off host 0 receives from another host: in the binomial tree a rank v ≥ K has its parent
    v − 2^m, 2^m > v/2, on a lower host), ``chain`` ``hosts − 1``. With one rank per host every
    edge crosses: world − 1, whatever the tree."""
    k = ranks_per_node
    if world < 1 or k < 1:
        raise GradzipError(f"broadcast_crossings: need world >= 1 and ranks_per_node >= 1, got {world} and {k}")
    if tree == "binomial":
        parents = {v: v - (1 << (v.bit_length() - 1)) for v in range(1, world)}
    elif tree == "chain":
        parents = {v: v - 1 for v in range(1, world)}
    elif tree == "linear":
        parents = {v: 0 for v in range(1, world)}
    else:
        raise GradzipError(f"unknown broadcast tree {tree!r}; choose binomial, chain or linear")
    return sum(parent // k != v // k for v, parent in parents.items())


def inter_multiplier(hosts: int, ranks_per_node: int = 1, *, hierarchical: bool = False, leader_only: bool = False,
                     exchange: str = "allreduce") -> int | None:
    """M such that ``M · bytes_inter`` (rank 0's, as metrics.jsonl records it) is what all ranks
    together sent between hosts in a step; None where no exact M is known.

    - one rank per host: ``hosts`` (every byte crosses; the ranks' counts are equal);
    - ``--hierarchical``, element-wise compressors: ``hosts · K``. Every rank exchanges its own
      node shard across nodes, and the shards are equal (padded), so every rank's ``bytes_inter``
      is rank 0's: exact, up to integer rounding;
    - ``--hierarchical``, per-tensor compressors (PowerSGD): ``hosts``: only the node leaders (rank
      0 is one) send across nodes. Exact for the compressed buckets; the small tensors that go
      uncompressed (``--min-compress-numel``) are exchanged shard-wise by every rank, so their
      inter-host bytes are counted K times too few (bert-tiny with a 512-word vocabulary on
      2 hosts × 2: 20 kB of about 270 kB per step; with the headers of PowerSGD's many small
      messages the wire then shows about +10 %);
    - flat exchange (no ``--hierarchical``) with K > 1: ``hosts`` for the ring collectives
      (``exchange`` ``allreduce`` or ``allgather``, Gloo's algorithms): the ring in rank order has
      ``hosts · K`` hops of equal bytes, ``hosts`` of them between hosts. The metric counts every
      byte of the world communicator as inter-node there, so it is rank 0's ``bytes_sent``. Other
      schemes (``twophase``, ``sparse``) mix pairwise patterns: None."""
    k = ranks_per_node
    if k == 1:
        return hosts
    if hierarchical:
        return hosts if leader_only else hosts * k
    return hosts if exchange in ("allreduce", "allgather") else None


def accounted_bytes(inter_per_step: list[float], params: int, hosts: int, ranks_per_node: int = 1, *,
                    multiplier: int | None = None, tree: str = "binomial") -> int | None:
    """The bytes the communication layer accounts for what crossed between hosts in a run:
    ``multiplier · Σ_steps inter_per_step + broadcast_crossings(hosts · K, K, tree) · 4 · params``.

    ``inter_per_step``: rank 0's bytes per step (``bytes_sent`` with one rank per host,
    ``bytes_inter`` else); ``multiplier``: :func:`inter_multiplier` (default ``hosts``, one rank
    per host; None: not modelled, the result is None); the second term is the start-up broadcast
    of the fp32 parameters from rank 0. With one rank per host this is ``hosts · Σ bytes_sent +
    (hosts − 1) · 4 · params`` for every tree."""
    m = hosts if multiplier is None and ranks_per_node == 1 else multiplier
    if m is None:
        return None
    startup = broadcast_crossings(hosts * ranks_per_node, ranks_per_node, tree) * 4 * params
    return int(m * sum(inter_per_step) + startup)


def _leader_only(spec: str) -> bool:
    """Whether the compressor of ``spec`` compresses whole tensors (PowerSGD): under
    ``--hierarchical`` only node leaders then exchange across nodes."""
    name, _ = parse_spec(spec)
    cls = registry().get(name)
    return bool(cls is not None and cls.per_tensor)


def wire_report(summary: dict[str, Any], before: list[testbed.HostCounters],
                after: list[testbed.HostCounters], sent_per_step: list[float] | None = None, *,
                ranks_per_node: int = 1, inter_per_step: list[float] | None = None) -> dict[str, Any]:
    """The wire-byte fields (see the module docstring) for a run's summary. ``sent_per_step``: the
    engine's ``bytes_sent`` of each step this invocation ran (default: every step of the summary);
    with ``ranks_per_node`` K > 1, ``inter_per_step`` (``bytes_inter``, default the summary's
    ``inter_bytes_per_step``) is accounted instead, as :func:`accounted_bytes` describes, with the
    backend's start-up broadcast tree and :func:`inter_multiplier` from the summary's
    ``hierarchical``, ``compressor`` and ``exchange``. One rank per host: the fields are as they
    always were."""
    hosts, k = len(before), ranks_per_node
    world = hosts * k
    tx = [a.tx_bytes - b.tx_bytes for a, b in zip(after, before)]
    frames = [a.shaped_bytes - b.shaped_bytes for a, b in zip(after, before)]
    steps_total = int(summary.get("steps") or 0)
    if sent_per_step is None:
        sent_per_step = [float(summary.get("bytes_per_step") or 0.0)] * steps_total
    steps = len(sent_per_step)
    params = int(summary.get("params") or 0)
    extra: dict[str, Any] = {}
    if k == 1:
        accounted: int | None = accounted_bytes(sent_per_step, params, hosts)
    else:
        if inter_per_step is None:
            inter_per_step = [float(summary.get("inter_bytes_per_step") or 0.0)] * steps_total
        tree = broadcast_tree(str(summary.get("backend")), world)
        mult = inter_multiplier(hosts, k, hierarchical=bool(summary.get("hierarchical")),
                                leader_only=_leader_only(str(summary.get("compressor") or "none")),
                                exchange=str(summary.get("exchange") or "allreduce"))
        accounted = accounted_bytes(inter_per_step, params, hosts, k, multiplier=mult, tree=tree)
        extra = {"accounted_startup_bytes": broadcast_crossings(world, k, tree) * 4 * params,
                 "accounted_inter_multiplier": mult}
    acc = accounted or 0
    return {
        "wire_bytes": sum(tx),
        "wire_frame_bytes": sum(frames),
        "wire_bytes_by_host": tx,
        "wire_drops": sum(a.drops - b.drops for a, b in zip(after, before)),
        "accounted_bytes": accounted,
        "wire_overhead": (sum(tx) / acc - 1.0) if acc > 0 else None,
        "wire_frame_overhead": (sum(frames) / acc - 1.0) if acc > 0 else None,
        "wire_bytes_per_step": sum(tx) / (world * steps) if steps else None,
        **extra,
    }


def add_wire_report(out: Path, spec: NetemSpec, tb: Testbed, how: str, before: list[testbed.HostCounters],
                    after: list[testbed.HostCounters], first_step: int = 0, *,
                    ranks_per_node: int = 1, netem_trace: str | None = None) -> dict[str, Any]:
    """Add the wire-byte fields and the testbed's description to ``out/summary.json``."""
    summary = json.loads((out / "summary.json").read_text())
    records = [r for r in read_metrics(out / "metrics.jsonl") if r.get("step", 0) > first_step]
    sent = [float(r.get("bytes_sent") or 0) for r in records]
    inter = [float(r.get("bytes_inter", r.get("bytes_sent")) or 0) for r in records]
    extra = wire_report(summary, before, after, sent, ranks_per_node=ranks_per_node, inter_per_step=inter)
    if netem_trace:  # each change replaced the qdiscs, whose counters start again from 0
        extra.update(wire_frame_bytes=None, wire_frame_overhead=None, wire_drops=None)
    extra["netem"] = {"spec": spec.text, "hosts": spec.hosts, "ranks_per_node": ranks_per_node, "prefix": tb.prefix,
                      "testbed": how, "addresses": [tb.host_addr(i) for i in range(spec.hosts)], "mtu": tb.mtu,
                      "loss_method": tb.loss_method, **asdict(spec.shaping), "rate": spec.shaping.rate_text,
                      "trace": netem_trace}
    return update_summary(out, extra)
