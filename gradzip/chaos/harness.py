"""One chaos run: ``groups`` replica groups of ``--sync ftdiloco`` or ``ftsparseloco`` (each a ``gradzip train --backend
gloo --workers R`` run of ``ranks`` = R ranks, DDP inside it), a Lighthouse process that outlives
them, and the faults of :mod:`gradzip.chaos.schedule` injected on time.

Placement: with ``hosts`` > 0 the run builds (or reuses) the emulated testbed of
:mod:`gradzip.netem` with that many hosts at ``link_rate``; group g runs inside host g mod hosts's
namespace (``ip netns exec``), the Lighthouse in host 0's, and every group advertises its host's
address (``host=``). With ``hosts`` = 0 everything runs on this machine over loopback (no
partition faults then).

Restarts: a killed group comes back ``recovery`` seconds later as a new process (a cold start:
interpreter, imports, model, data, then its join sync), or with ``warm_spare`` = K as one of its K
*warm spares*: processes started ahead of time with ``standby=FILE`` in their ``--sync``, built and
idle (``FILE.waiting`` says so), whose Manager starts only when the harness creates FILE. The first
K per group are built before the founders start; each one brought in is replaced at once by a new
one at niceness 19, so that its start-up takes no CPU from the live groups on a shared machine (as
a spare on a machine of its own would not); a spare brought in is set back to niceness 0.

Time: the clock starts at the *founding sync* (the first committed join sync of the founding
groups); faults and late starts are placed from it, and the run ends ``duration`` seconds after it:
every group gets SIGCONT, every partition is lifted, then SIGTERM (SIGKILL 10 s later).

Files in ``out``: ``settings.json``; ``schedule.json`` (the faults and late starts, before the run);
``events.jsonl`` (what was done, when: launches, kills, restarts, stalls, resumes, partitions,
skipped faults, unexpected exits); ``timeline.jsonl`` (every line the groups append to ``ft.jsonl``
and ``metrics.jsonl``, stamped with the time the harness read it, polled every 0.1 s); and
``groups/gG/runK/``: the K-th process of group G (its ``--out``, ``log.txt``).
"""

from __future__ import annotations

import heapq
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from gradzip.chaos import control, procs, schedule
from gradzip.chaos.procs import signal_tree
from gradzip.chaos.timeline import Timeline
from gradzip.errors import GradzipError
from gradzip.netem import shaping, testbed
from gradzip.netem.iproute import HOST_IF, run_tool, tool
from gradzip.netem.spec import Shaping, parse_rate

POLL_S = 0.1
FOUNDING_LIMIT_S = 300.0  # the founders must have synced once by then
SINK = "1:30"  # the htb class whose queue holds nothing: a partitioned host's egress goes there
PARTITION_PREF = "1"
GO_FILE = "go"  # a warm spare's signal to join, in its --out directory


@dataclass
class Settings:
    """A chaos run's settings (``settings.json``); the defaults are the documented ones."""

    out: str
    groups: int = 4
    ranks: int = 1  # gloo ranks per group (DDP inside it)
    hosts: int = 2
    link_rate: str = "100mbit"
    duration: float = 180.0
    rate: float = 0.0  # faults per minute
    kinds: tuple[str, ...] = ("kill", "stall", "partition")
    seed: int = 0
    recovery: float = 5.0
    stall: float = 10.0
    partition: float = 6.0
    late: int = 0
    late_at: float = 30.0
    every: int = 32
    min_replicas: int = 1
    timeout: float = 10.0
    heartbeat_ms: int = 3000
    join_timeout_ms: int = 10000
    port: int = 29510
    prefix: str = "chaos"
    model: str = "bert-tiny"
    compressor: str = "topk:ratio=0.01,ef=true"  # "" under ftsparseloco (its codec is its own)
    mode: str = "ftdiloco"  # the groups' --sync mode: ftdiloco or ftsparseloco
    batch_size: int = 8
    seq_len: int = 64
    train_seed: int = 1
    train_args: list[str] = field(default_factory=list)
    control_priority: bool = True  # the Lighthouse's port in each host's priority class (shaping.prioritize_ports)
    probe_control: bool = False  # time the control plane from the last host (gradzip.chaos.control)
    warm_spare: int = 0  # built, idle standby processes per group; one replaces a killed group at once
    python: str = sys.executable

    @property
    def batch_tokens(self) -> int:
        return self.batch_size * self.seq_len

    def faults(self) -> list[schedule.ScheduledFault]:
        return schedule.build(self.seed, self.rate, self.duration, self.groups, max(self.hosts, 1), self.kinds,
                              self.recovery, self.stall, self.partition)


@dataclass
class Proc:
    """One process of a group (its K-th incarnation)."""

    group: int
    inc: int
    popen: subprocess.Popen[bytes]
    out: Path
    log: IO[bytes]
    stopped: bool = False
    ended_by_us: bool = False


class Harness:
    """Runs one chaos run (module docstring). :meth:`run` returns the output directory."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self.out = Path(s.out)
        self.tb: testbed.Testbed | None = None
        self.created = False
        self.procs: dict[int, Proc] = {}  # each group's newest process
        self.spares: dict[int, list[Proc]] = {}  # each group's warm spares (--warm-spare), oldest first
        self.history: list[Proc] = []  # every process, in launch order
        self.incs: dict[int, int] = {}
        self.partitioned: set[int] = set()
        self.lighthouse: subprocess.Popen[bytes] | None = None
        self.probe: subprocess.Popen[bytes] | None = None
        self.queue: list[tuple[float, int, str, dict[str, Any]]] = []
        self._seq = 0
        self.t_start = time.monotonic()
        self.t0: float | None = None  # the founding sync, in harness time
        self.events: IO[str] | None = None
        self.timeline: Timeline | None = None

    # ------------------------------------------------------------------ setup and teardown
    def run(self) -> Path:
        s = self.s
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "settings.json").write_text(json.dumps(asdict(s), indent=1) + "\n")
        faults = s.faults()
        late = schedule.late_starts(s.groups, s.late, s.late_at)
        (self.out / "schedule.json").write_text(json.dumps(
            {"faults": [f.to_dict() for f in faults], "late": {str(g): t for g, t in late.items()}}, indent=1) + "\n")
        self.events = (self.out / "events.jsonl").open("a", encoding="utf-8")
        self.timeline = Timeline(self.out / "timeline.jsonl", self.t_start)
        try:
            self._testbed_up()
            self._start_lighthouse()
            self._start_probe()
            self._build_spares()
            for g in range(s.groups - s.late):
                self._launch(g)
            self._wait_founding()
            for i, f in enumerate(faults):
                self._at(f.t, f.kind, {"fault": i, "target": f.target, "duration": f.duration})
            for g, t in late.items():
                self._at(t, "late", {"group": g})
            self._loop(s.duration)
        finally:
            self._teardown()
        return self.out

    def _testbed_up(self) -> None:
        s = self.s
        if s.hosts == 0:
            return
        self.tb, what = testbed.up(s.hosts, Shaping(parse_rate(s.link_rate)), prefix=s.prefix)
        self.created = what == "created"
        for h in range(s.hosts):  # the partition sink: an htb class whose bfifo holds 0 bytes
            ns = self.tb.host_ns(h)
            run_tool("tc", "-n", ns, "class", "replace", "dev", HOST_IF, "parent", "1:", "classid", SINK, "htb",
                     "rate", "1mbit", "quantum", "60000")
            run_tool("tc", "-n", ns, "qdisc", "replace", "dev", HOST_IF, "parent", SINK, "handle", "30:", "bfifo",
                     "limit", "0")
            if s.control_priority:  # heartbeats and quorum RPCs never queue behind the exchange
                shaping.prioritize_ports(ns, (s.port,))
        self._event("testbed", prefix=s.prefix, hosts=s.hosts, rate=s.link_rate, state=what,
                    control_priority=s.control_priority)

    def _prefix(self, host: int) -> list[str]:
        return [] if self.tb is None else [tool("ip"), "netns", "exec", self.tb.host_ns(host)]

    def _addr(self, host: int) -> str:
        return "127.0.0.1" if self.tb is None else self.tb.host_addr(host)

    def _start_lighthouse(self) -> None:
        s = self.s
        port = s.port if self.tb is not None else 0
        cmd = [*self._prefix(0), s.python, "-m", "gradzip.chaos.lighthouse", "--port", str(port), "--min-replicas",
               str(s.min_replicas), "--join-timeout-ms", str(s.join_timeout_ms), "--heartbeat-timeout-ms",
               str(s.heartbeat_ms)]
        self.lighthouse = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self._env(),
                                           start_new_session=True)
        assert self.lighthouse.stdout is not None
        line = self.lighthouse.stdout.readline().decode().strip()
        if not line:
            raise GradzipError(f"the Lighthouse did not start (exit code {self.lighthouse.wait()})")
        self.lighthouse_addr = f"http://{self._addr(0)}:{line.rsplit(':', 1)[1]}"
        self._event("lighthouse", address=self.lighthouse_addr)

    def _start_probe(self) -> None:
        """The control-plane probe, from the last host (the far side of the link from the Lighthouse)."""
        if not self.s.probe_control or self.tb is None:
            return
        ns = ",".join(self.tb.host_ns(h) for h in range(self.s.hosts))
        cmd = [*self._prefix(self.s.hosts - 1), self.s.python, "-m", "gradzip.chaos.control", "--host",
               self._addr(0), "--port", str(self.s.port), "--ns", ns, "--out", str(self.out / control.PROBE_FILE)]
        self.probe = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=self._env(), start_new_session=True)
        self._event("probe", pid=self.probe.pid)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="warn")
        if self.tb is not None:
            env["GLOO_SOCKET_IFNAME"] = HOST_IF
        return env

    def _teardown(self) -> None:
        if self.probe is not None:  # first: its last samples see live groups, not their teardown
            self.probe.terminate()
            self.probe.wait(15)
        for p in [*self.procs.values(), *(q for ps in self.spares.values() for q in ps)]:
            if p.popen.poll() is None:
                p.ended_by_us = True
                signal_tree(p.popen.pid, signal.SIGCONT)
                signal_tree(p.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.history:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_tree(p.popen.pid, signal.SIGKILL)
                p.popen.wait()
            p.log.close()
        if self.timeline is not None:
            self.timeline.poll(self.history)
            self.timeline.close()
        for h in sorted(self.partitioned):
            self._unpartition(h)
        if self.lighthouse is not None:
            self.lighthouse.terminate()
            try:
                self.lighthouse.wait(10)
            except subprocess.TimeoutExpired:
                self.lighthouse.kill()
        if self.created:
            testbed.down(self.s.prefix)
        if self.events is not None:
            self._event("end")
            self.events.close()

    # ------------------------------------------------------------------ the groups
    def _launch(self, g: int, standby: bool = False, nice: bool = False) -> Proc:
        """Group ``g``'s next process; ``standby``: a warm spare, which builds everything and then
        waits for its go file (:meth:`_activate`) before its Manager starts; ``nice``: at niceness
        19."""
        s = self.s
        inc = self.incs.get(g, -1) + 1
        self.incs[g] = inc
        out = self.out / "groups" / f"g{g}" / f"run{inc}"
        out.mkdir(parents=True, exist_ok=True)
        host = g % max(s.hosts, 1)
        founders = s.groups - s.late
        sync = (f"{s.mode}:every={s.every},groups={founders if g < founders else s.groups},group={g},"
                f"min_replicas={s.min_replicas},lighthouse={self.lighthouse_addr}")
        if self.tb is not None:
            sync += f",host={self._addr(host)}"
        if standby:
            sync += f",standby={out / GO_FILE}"
        cmd = [*self._prefix(host), s.python, "-m", "gradzip", "train", "--backend", "gloo", "--workers", str(s.ranks),
               "--model", s.model, *(["--compressor", s.compressor] if s.compressor else []), "--sync", sync,
               "--batch-size", str(s.batch_size),
               "--seq-len", str(s.seq_len), "--seed", str(s.train_seed + g + 1000 * inc), "--steps", "1000000",
               "--timeout", f"{s.timeout:g}", "--eval-every", str(s.every), "--no-progress", "--out", str(out),
               *s.train_args]
        log = (out.parent / f"log{inc}.txt").open("wb")
        popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self._env(), start_new_session=True,
                                 preexec_fn=procs.nice_spare if nice else None)
        p = Proc(g, inc, popen, out, log)
        self.history.append(p)
        if standby:
            self.spares.setdefault(g, []).append(p)
            self._event("spare", group=g, inc=inc, host=host, pid=popen.pid, nice=nice)
        else:
            self.procs[g] = p
            self._event("launch", group=g, inc=inc, host=host, pid=popen.pid)
        return p

    def _build_spares(self) -> None:
        """``warm_spare`` spares per group, at normal priority, all built before the founders start
        (outside the measured window); a spare that does not get there in time is left to finish."""
        for g in range(self.s.groups):
            for _ in range(self.s.warm_spare):
                self._launch(g, standby=True)
        deadline = self._now() + FOUNDING_LIMIT_S
        while not all(_ready(p) or p.popen.poll() is not None for ps in self.spares.values() for p in ps):
            if self._now() > deadline:
                break
            time.sleep(POLL_S)
        if self.spares:
            self._event("spares", ready=sum(_ready(p) for ps in self.spares.values() for p in ps))

    def _activate(self, g: int) -> Proc:
        """Group ``g`` (re)starts: one of its warm spares, if it has a live one (a built one first),
        is told to go, at normal priority (its ``launch`` event is now: the report's start-up is
        go → first quorum request), and a new spare (niceness 19) is started behind it; otherwise a
        new process (a cold start)."""
        live = [p for p in self.spares.get(g, []) if p.popen.poll() is None]
        spare = next((p for p in live if _ready(p)), live[0] if live else None)
        if spare is None:
            p = self._launch(g)
        else:
            self.spares[g].remove(spare)
            reniced = procs.renice(spare.popen.pid, 0)
            (spare.out / GO_FILE).touch()
            self.procs[g] = p = spare
            self._event("launch", group=g, inc=spare.inc, host=g % max(self.s.hosts, 1), pid=spare.popen.pid,
                        warm=True, ready=_ready(spare), reniced=reniced)
        if self.s.warm_spare:
            self._launch(g, standby=True, nice=True)
        return p

    def _wait_founding(self) -> None:
        assert self.timeline is not None
        while self.t0 is None:
            self._tick()
            if any(r["rec"]["committed"] for r in self.timeline.ft):
                self.t0 = self._now()
                self._event("founding")
            elif self._now() > FOUNDING_LIMIT_S:
                raise GradzipError(f"the founding sync did not happen within {FOUNDING_LIMIT_S:g} s; see the "
                                   f"groups' logs under {self.out / 'groups'}")
            time.sleep(POLL_S)

    def _now(self) -> float:
        return time.monotonic() - self.t_start

    def _rel(self) -> float:
        return self._now() - (self.t0 or 0.0)

    def _at(self, t: float, action: str, args: dict[str, Any]) -> None:
        self._seq += 1
        heapq.heappush(self.queue, (t, self._seq, action, args))

    def _event(self, event: str, **kw: Any) -> None:
        assert self.events is not None
        rel = None if self.t0 is None else round(self._rel(), 3)
        self.events.write(json.dumps({"t": round(self._now(), 3), "rel": rel, "event": event, **kw}) + "\n")
        self.events.flush()

    def _tick(self) -> None:
        """Read the groups' new lines; record (and restart after ``recovery``) a group that exited
        on its own."""
        assert self.timeline is not None
        self.timeline.poll(self.history)
        for p in list(self.procs.values()):
            rc = p.popen.poll()
            if rc is not None and not p.ended_by_us:
                p.ended_by_us = True
                self._event("exit", group=p.group, inc=p.inc, rc=rc)
                if self.t0 is not None:
                    self._at(self._rel() + self.s.recovery, "restart", {"group": p.group})
        self._tick_spares()

    def _tick_spares(self) -> None:
        """Record a spare that died (and drop it)."""
        for g, p in [(g, p) for g, ps in self.spares.items() for p in ps]:
            if (rc := p.popen.poll()) is not None:
                p.ended_by_us = True
                self.spares[g].remove(p)
                self._event("spare-exit", group=g, inc=p.inc, rc=rc)

    def _loop(self, duration: float) -> None:
        while self._rel() < duration:
            self._tick()
            while self.queue and self.queue[0][0] <= self._rel():
                _, _, action, args = heapq.heappop(self.queue)
                self._do(action, args)
            time.sleep(POLL_S)

    def _joined(self, p: Proc) -> bool:
        """The process has committed a sync (its join): it is live, not starting or healing."""
        assert self.timeline is not None
        return any(r["group"] == p.group and r["inc"] == p.inc and r["rec"]["committed"] for r in self.timeline.ft)

    def _live(self) -> list[int]:
        return [g for g, p in self.procs.items() if p.popen.poll() is None and not p.stopped]

    def _do(self, action: str, a: dict[str, Any]) -> None:
        """One scheduled action: a fault, or the end of one (a restart, a resume, a link back)."""
        if action in ("kill", "stall"):
            g = a["target"]
            p = self.procs.get(g)
            if p is None or p.popen.poll() is not None or p.stopped or not self._joined(p):
                self._event("skip", fault=a["fault"], kind=action, group=g, why="down, restarting or stalled")
            elif self._live() == [g]:
                self._event("skip", fault=a["fault"], kind=action, group=g, why="the last live group")
            elif action == "kill":
                p.ended_by_us = True
                signal_tree(p.popen.pid, signal.SIGKILL)
                self._event("kill", fault=a["fault"], group=g, inc=p.inc)
                self._at(self._rel() + a["duration"], "restart", {"group": g})
            else:
                signal_tree(p.popen.pid, signal.SIGSTOP)
                p.stopped = True
                self._event("stall", fault=a["fault"], group=g, inc=p.inc)
                self._at(self._rel() + a["duration"], "resume", {"group": g})
        elif action == "partition":
            h = a["target"]
            if self.tb is None or h in self.partitioned:
                self._event("skip", fault=a["fault"], kind=action, host=h, why="no testbed or already cut off")
            else:
                self._partition(h)
                self._event("partition", fault=a["fault"], host=h,
                            groups=[g for g in self.procs if g % self.s.hosts == h])
                self._at(self._rel() + a["duration"], "link", {"host": h})
        elif action == "restart" or action == "late":
            p = self._activate(a["group"])
            self._event(action, group=p.group, inc=p.inc)
        elif action == "resume":
            p = self.procs[a["group"]]
            signal_tree(p.popen.pid, signal.SIGCONT)
            p.stopped = False
            self._event("resume", group=p.group, inc=p.inc)
        elif action == "link":
            self._unpartition(a["host"])
            self._event("link", host=a["host"])

    def _partition(self, h: int) -> None:
        assert self.tb is not None
        run_tool("tc", "-n", self.tb.host_ns(h), "filter", "add", "dev", HOST_IF, "parent", "1:", "pref",
                 PARTITION_PREF, "protocol", "all", "u32", "match", "u32", "0", "0", "flowid", SINK)
        self.partitioned.add(h)

    def _unpartition(self, h: int) -> None:
        assert self.tb is not None
        run_tool("tc", "-n", self.tb.host_ns(h), "filter", "del", "dev", HOST_IF, "parent", "1:", "pref",
                 PARTITION_PREF, check=False)
        self.partitioned.discard(h)


def _ready(p: Proc) -> bool:
    """The spare is built and waiting for its go file."""
    return (p.out / (GO_FILE + ".waiting")).exists()
