"""``gradzip chaos run`` (one chaos run: groups, Lighthouse, faults, summary) and ``gradzip chaos
compare`` (several runs against their fault-free ones: goodput measured and modelled, figures).
See docs/fault-tolerance.md ("Chaos harness")."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from gradzip.errors import GradzipError

EPILOG = """\
Examples:
  gradzip chaos run --groups 4 --hosts 2 --rate 100mbit --faults-per-minute 1 --seed 1 --out runs/chaos-f1
  gradzip chaos run --hosts 0 --groups 2 --faults-per-minute 0 --duration 60 --out runs/chaos-local
  gradzip chaos compare runs/chaos-f0 runs/chaos-f1 runs/chaos-f4 --out runs/chaos-figures
  gradzip chaos control-plane runs/cp-off runs/cp-on --out runs/cp
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="chaos_cmd", metavar="ACTION", required=True)
    r = sub.add_parser("run", help="one chaos run: replica groups on the testbed, faults from a seed")
    a = r.add_argument
    a("--out", required=True, help="output directory (must be new or empty)")
    a("--groups", type=int, default=4, help="replica groups, one gradzip train run each (default 4)")
    a("--ranks", type=int, default=1, help="gloo ranks per group, DDP inside it: each group's --workers "
      "(default 1)")
    a("--hosts", type=int, default=2, help="emulated hosts the groups are spread over (group g on host g mod "
      "hosts); 0: every group on this machine over loopback, no root needed (default 2)")
    a("--rate", default="100mbit", help="egress rate of every emulated host, e.g. 100mbit (default 100mbit)")
    a("--prefix", default="chaos", help="the testbed's prefix (namespaces PREFIX-hI) (default chaos)")
    a("--duration", type=float, default=180.0, help="seconds from the founding sync to the end (default 180)")
    a("--faults-per-minute", type=float, default=0.0, help="fault rate of the whole run, exponential "
      "inter-arrival times (default 0)")
    a("--kinds", default="kill,stall,partition", help="faults to draw from: kill, stall, partition (default all)")
    a("--seed", type=int, default=0, help="the fault schedule's seed (default 0)")
    a("--recovery", type=float, default=5.0, help="a killed group restarts after this many seconds (default 5)")
    a("--stall", type=float, default=10.0, help="a stalled group (SIGSTOP) resumes after this many seconds "
      "(default 10)")
    a("--partition", type=float, default=6.0, help="a partitioned host's egress is dropped this long (default 6)")
    a("--late", type=int, default=0, help="the last LATE groups start late, --late-at seconds apart (default 0)")
    a("--late-at", type=float, default=30.0, help="seconds after the founding sync of the first late start")
    a("--every", type=int, default=32, help="H: inner steps per sync (default 32)")
    a("--min-replicas", type=int, default=1, help="groups a sync needs to commit (default 1)")
    a("--timeout", type=float, default=10.0, help="each group's --timeout: a collective, commit or heal that "
      "takes longer fails (a stalled peer is given up after it) (default 10)")
    a("--heartbeat-ms", type=int, default=3000, help="the Lighthouse's heartbeat expiry (default 3000)")
    a("--join-timeout-ms", type=int, default=10000, help="how long the Lighthouse waits for a live group that "
      "has not asked for the quorum yet (default 10000)")
    a("--port", type=int, default=29510, help="the Lighthouse's port on host 0 (default 29510)")
    a("--model", default="bert-tiny")
    a("--mode", choices=("ftdiloco", "ftsparseloco"), default="ftdiloco", help="the groups' --sync mode: "
      "DiLoCo through --compressor, or SparseLoCo with its own codec (default ftdiloco)")
    a("--compressor", default=None, help="ftdiloco's compressor (default topk:ratio=0.01,ef=true); not with "
      "--mode ftsparseloco")
    a("--batch-size", type=int, default=8)
    a("--seq-len", type=int, default=64)
    a("--train-seed", type=int, default=1, help="group g's --seed is this + g (+ 1000 per restart)")
    a("--train-args", default="", help="more gradzip train flags, one string (e.g. \"--lr 2e-3 --eval-batches 4\")")
    a("--control-priority", choices=("on", "off"), default="on", help="on: traffic to/from the Lighthouse's "
      "port is served before the exchange on every host's egress, as a deployment's traffic class would (default "
      "on; off: one queue, to measure the difference)")
    a("--probe-control", action="store_true", help="time a request to the Lighthouse from the last host every "
      "0.1 s, with the hosts' queued bytes and the heartbeats' ages (control_probe.jsonl; needs --hosts >= 2)")
    a("--warm-spare", type=int, nargs="?", const=1, default=0, metavar="K", help="keep K built, idle standby "
      "processes per group (imports, model and data done, Manager not started; K = 1 when given alone), built "
      "before the founders start; a killed or late group's spare joins at once and a new one starts behind it "
      "at niceness 19 (default 0: a restart is a new process)")
    a("--loss-bound", type=float, default=0.5, help="a heal's loss jump above this (nat) is a discontinuity")
    cp = sub.add_parser("control-plane", help="control-plane latency of --probe-control runs, idle and during "
                        "exchanges (control_plane.json, .md)")
    cp.add_argument("runs", nargs="+", help="chaos run directories made with --probe-control")
    cp.add_argument("--out", required=True, help="directory for control_plane.json and control_plane.md")
    c = sub.add_parser("compare", help="runs against their fault-free ones: goodput (measured, modelled), figures")
    c.add_argument("runs", nargs="+", help="chaos run directories (those at 0 faults/min are the baseline)")
    c.add_argument("--out", required=True, help="directory for compare.json, compare.md and the figures")


def settings(args: argparse.Namespace) -> Any:
    """The run's :class:`~gradzip.chaos.harness.Settings`, every value checked (one line otherwise)."""
    from gradzip.chaos import harness, schedule  # noqa: PLC0415
    from gradzip.netem.spec import parse_rate  # noqa: PLC0415

    if args.groups < 1 or args.hosts < 0:
        raise GradzipError(f"--groups must be >= 1 and --hosts >= 0, got {args.groups} and {args.hosts}")
    if args.hosts > args.groups:
        raise GradzipError(f"--hosts {args.hosts} is more than the {args.groups} groups; give at most --groups")
    schedule.late_starts(args.groups, args.late, args.late_at)  # --late, checked first
    if not 1 <= args.min_replicas <= args.groups - args.late:
        raise GradzipError(f"--min-replicas {args.min_replicas} must be in [1, {args.groups - args.late}] (the "
                           "groups that found the run)")
    for name in ("duration", "recovery", "stall", "partition", "late_at", "timeout"):
        if not getattr(args, name) > 0:
            raise GradzipError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name):g}")
    if args.mode == "ftsparseloco" and args.compressor is not None:
        raise GradzipError(f"--mode ftsparseloco sends its own codec: drop --compressor {args.compressor}")
    compressor = "" if args.mode == "ftsparseloco" else args.compressor or "topk:ratio=0.01,ef=true"
    if args.ranks < 1:
        raise GradzipError(f"--ranks must be >= 1 gloo ranks per group, got {args.ranks}")
    if args.warm_spare < 0:
        raise GradzipError(f"--warm-spare must be >= 0 spares per group, got {args.warm_spare}")
    if args.every < 1:
        raise GradzipError(f"--every must be >= 1, got {args.every}")
    if args.probe_control and args.hosts < 2:
        raise GradzipError(f"--probe-control times the link between hosts: give --hosts >= 2, got {args.hosts}")
    kinds = schedule.parse_kinds(args.kinds)
    if "partition" in kinds and args.hosts == 0 and args.faults_per_minute > 0:
        raise GradzipError("--kinds partition needs the emulated testbed: give --hosts >= 1 (root), or leave "
                           "partition out of --kinds")
    if args.hosts > 0:
        try:
            parse_rate(args.rate)
        except GradzipError as e:
            raise GradzipError(f"--rate {args.rate}: {e}") from None
    s = harness.Settings(out=args.out, groups=args.groups, ranks=args.ranks, hosts=args.hosts, link_rate=args.rate,
                         duration=args.duration, rate=args.faults_per_minute, kinds=kinds, seed=args.seed,
                         recovery=args.recovery, stall=args.stall, partition=args.partition, late=args.late,
                         late_at=args.late_at, every=args.every, min_replicas=args.min_replicas,
                         timeout=args.timeout, heartbeat_ms=args.heartbeat_ms, join_timeout_ms=args.join_timeout_ms,
                         port=args.port, prefix=args.prefix, model=args.model, compressor=compressor,
                         batch_size=args.batch_size, seq_len=args.seq_len, train_seed=args.train_seed,
                         train_args=shlex.split(args.train_args), control_priority=args.control_priority == "on",
                         probe_control=args.probe_control, warm_spare=args.warm_spare, mode=args.mode)
    s.faults()  # the rate, checked
    return s


def _check_machine(s: Any) -> None:
    from gradzip.netem import testbed  # noqa: PLC0415

    if importlib.util.find_spec("torchft") is None:
        raise GradzipError('fault tolerance needs torchft: pip install "gradzip[ft]"')
    if s.hosts > 0:
        try:
            testbed.check_privileges()
        except GradzipError as e:
            raise GradzipError(f"the emulated testbed needs root: {e} (or give --hosts 0 to run every group on "
                               "this machine without it)") from None
        testbed.validate_prefix(s.prefix)
    out = Path(s.out)
    if out.exists() and any(out.iterdir()):
        raise GradzipError(f"--out {out} is not empty; give a new directory")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    try:
        if args.chaos_cmd == "compare":
            from gradzip.chaos import compare  # noqa: PLC0415

            res = compare.compare(args.runs, args.out)
            print(compare.table(res))
            return 0
        if args.chaos_cmd == "control-plane":
            from gradzip.chaos import control  # noqa: PLC0415

            print(control.table(control.report(args.runs, args.out)["runs"]))
            return 0
        s = settings(args)
        _check_machine(s)
    except (GradzipError, ValueError) as e:
        print(f"gradzip chaos: {e}", file=sys.stderr)
        return 2
    from gradzip.chaos import harness, report  # noqa: PLC0415

    signal.signal(signal.SIGTERM, _raise_interrupt)  # teardown runs on SIGTERM too
    try:
        out = harness.Harness(s).run()
    except GradzipError as e:
        print(f"gradzip chaos: {e}", file=sys.stderr)
        return 1
    summary = report.summarize(out, args.loss_bound)
    print((out / "summary.md").read_text(), end="")
    print(json.dumps({k: summary[k] for k in ("goodput_tokens_per_s", "participation_ok", "heals_bit_exact",
                                              "heals_checked", "loss_continuous")}))
    return 0
