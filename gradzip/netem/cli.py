"""``gradzip netem {up,status,down,reshape}``: emulated hosts with shaped links on this machine.

Needs Linux, root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2 (`ip`, `tc`).
See :mod:`gradzip.netem.testbed` for the layout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gradzip.errors import GradzipError
from gradzip.netem import testbed, trace
from gradzip.netem.spec import parse_rate
from gradzip.units import parse_latency

EPILOG = """\
Layout: one network namespace per host (PREFIX-h0 .. PREFIX-hN-1, interface eth0, address
198.18.0.(i+1)/24 from the benchmarking range 198.18.0.0/15), each connected by a veth pair to a
bridge in namespace PREFIX-br. Each host's egress is shaped by tc (htb rate; netem delay/loss).
Nothing is added to the root namespace and no traffic leaves the machine.
Run a command on host i:  ip netns exec gz-hI COMMAND
Examples:
  gradzip netem up --hosts 4 --rate 1gbit --delay 0.1ms
  gradzip netem reshape --trace link.txt --log link.jsonl   # rows of 'time_s, rate'
  gradzip netem status
  gradzip netem down
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="netem_cmd", metavar="ACTION", required=True)
    pu = sub.add_parser("up", help="build the testbed (idempotent; new shaping reshapes it)")
    pu.add_argument("--hosts", type=int, default=4, help="number of emulated hosts (default 4)")
    pu.add_argument("--rate", default="1gbit",
                    help="egress rate of every host, e.g. 100mbit, 1gbit, or unshaped (no limit) (default 1gbit)")
    pu.add_argument("--delay", default="0",
                    help="added one-way delay per packet, e.g. 0.1ms (default 0; needs sch_netem)")
    pu.add_argument("--loss", default="0", help="random loss in percent of packets, e.g. 0.1 (default 0)")
    pu.add_argument("--mtu", type=int, default=1500, help="MTU of the links (default 1500)")
    pu.add_argument("--subnet", default=testbed.DEFAULT_SUBNET,
                    help="IPv4 subnet inside 198.18.0.0/15 (default %(default)s)")
    for name, help_ in (("status", "show hosts, addresses, shaping and interface counters"),
                        ("down", "remove everything (idempotent)")):
        p = sub.add_parser(name, help=help_)
        if name == "status":
            p.add_argument("--json", action="store_true", help="machine-readable output")
    pr = sub.add_parser("reshape", help="change the shaping of the running testbed, once (--rate) or over time "
                        "(--trace FILE of 'time, rate[, delay[, loss]]' rows)")
    pr.add_argument("--rate", help="egress rate of every host, e.g. 100mbit, or unshaped")
    pr.add_argument("--delay", default="0")
    pr.add_argument("--loss", default="0")
    pr.add_argument("--trace", metavar="FILE", help="play FILE's rows (or a shipped trace's, by name): at each "
                    "row's time (seconds from now) apply its rate, delay and loss (gradzip.netem.trace)")
    pr.add_argument("--repeat", action="store_true",
                    help="--trace: start over after --period seconds, until interrupted")
    pr.add_argument("--period", type=float, help="--trace --repeat: seconds per pass (default: the last row's time "
                    "plus the gap before it)")
    pr.add_argument("--log", metavar="FILE", help="--trace: append each change as a JSON line (time, rate) to FILE")
    for p in (pu, pr, *(sub.choices[n] for n in ("status", "down"))):
        p.add_argument("--prefix", default=testbed.DEFAULT_PREFIX,
                       help="name prefix of the namespaces (default %(default)s), for several testbeds")


def _shaping(args: argparse.Namespace) -> testbed.Shaping:
    return testbed.Shaping(parse_rate(args.rate), parse_latency(args.delay), testbed.parse_loss(args.loss))


def run(args: argparse.Namespace) -> int:
    cmd = args.netem_cmd
    if cmd == "up":
        tb, what = testbed.up(args.hosts, _shaping(args), args.prefix, args.subnet, args.mtu)
        print(f"testbed {tb.prefix}: {what}: {tb.hosts} hosts {tb.host_addr(0)}..{tb.host_addr(tb.hosts - 1)}, "
              f"egress {tb.shaping.describe()} per host")
        return 0
    if cmd == "reshape" and (args.trace is None) == (args.rate is None):
        raise GradzipError("gradzip netem reshape: give --rate (one change) or --trace FILE (changes over time)")
    if cmd == "reshape" and args.trace is not None:
        # a bad trace fails before the testbed is touched
        points = trace.read_trace(trace.resolve_trace(args.trace))
        log = Path(args.log) if args.log else None
        n = trace.play(points, lambda sh: testbed.reshape(args.prefix, sh), log, args.repeat, args.period)
        print(f"testbed {args.prefix}: played {n} change(s) of {args.trace}" + (f"; log: {log}" if log else ""))
        return 0
    if cmd == "reshape":
        tb = testbed.reshape(args.prefix, _shaping(args))
        print(f"testbed {tb.prefix}: reshaped: egress {tb.shaping.describe()} per host")
        return 0
    if cmd == "down":
        removed = testbed.down(args.prefix)
        print(f"testbed {args.prefix}: " + (f"removed {len(removed)} namespaces" if removed else "nothing was up"))
        return 0
    st = testbed.status(args.prefix)
    if args.json:
        json.dump(st, sys.stdout, indent=1)
        print()
        return 0 if st else 1
    if st is None:
        print(f"testbed {args.prefix}: down")
        return 1
    if st["state"] != "up":
        miss = st.get("missing") or []
        print(f"testbed {args.prefix}: broken (missing {', '.join(miss) or 'state file'}); "
              f"run `gradzip netem down --prefix {args.prefix}`")
        return 1
    print(f"testbed {st['prefix']}: up, {st['hosts']} hosts on {st['subnet']} (bridge in netns {st['prefix']}-br), "
          f"MTU {st['mtu']}, egress {st['shaping_text']} per host"
          + (f" (loss via {st['loss_method']})" if st["loss_method"] != "none" else ""))
    print(f"  {'host':<10} {'address':<15} {'tx bytes':>14} {'tx pkts':>10} {'rx bytes':>14} {'drops':>7}")
    for h, c in zip(st["host_list"], st["counters"]):
        print(f"  {h['namespace']:<10} {h['address']:<15} {c['tx_bytes']:>14,} {c['tx_packets']:>10,} "
              f"{c['rx_bytes']:>14,} {c['drops']:>7,}")
    return 0
