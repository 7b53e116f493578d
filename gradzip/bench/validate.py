"""Validate ``gradzip simulate`` against real training in the network testbed.

``python -m gradzip.bench.validate [--hosts 2 3] [--rates 25mbit 50mbit 100mbit]
[--compressors none fp16 topk:ratio=0.01,ef=true] [--steps 10] [--md FILE]`` (root; ~10 min on 2 cores)

For every host count H and compressor C:

1. calibration: ``gradzip train --backend gloo --netem H:10gbit`` (``--calibration-steps`` steps)
   — the network is not the bottleneck; the medians of its per-step ``compute_s + opt_s`` and
   ``compress_s`` (this machine's measured compute and encode/decode time for H ranks sharing its
   cores) calibrate the model;
2. for every rate R: ``gradzip train --backend gloo --netem H:R``, measured step time = median of
   ``step_s`` over the steps after the first ``--warmup``;
3. prediction: :func:`gradzip.cluster.simulate.predict` for H nodes × 1 GPU, bandwidth R,
   link efficiency 1448/1514 (TCP/IPv4 with timestamps over Ethernet, MTU 1500: the shaper
   counts every frame's headers), α = half the testbed's measured TCP round trip, overlap 0 (with
   bert-tiny every bucket is ready only at the end of backward), compute and compression from (1).

Error = predicted / measured − 1, per configuration. A second error replaces the calibration's
compute and compression by the run's own measured ones, so that it isolates the network model
(on a shared machine, compute time drifts between runs). A third, step-calibrated, takes for
compute the calibration run's median ``step_s`` less its own predicted communication and
compression: it then includes the time the ranks wait for each other, which the model has no term
for and which dominates when more ranks than cores share the machine.

Several ranks per host: ``--ranks-per-node K`` runs every configuration with K ranks on each
emulated host (``gradzip train --ranks-per-node K``: H × K ranks, the ranks of a host talk over
its loopback), and ``--modes flat hierarchical`` runs each compressor with the flat exchange, with
``--hierarchical``, or both (calibrated separately). The prediction is then for H nodes × K GPUs:
inter-node bandwidth R, intra-node bandwidth ``--intra-bandwidth`` (default 10gbit) and latency
half the TCP round trip inside a host, ``Workload(hierarchical=True)`` for the hierarchical runs
(flat runs: ring collectives in rank order, as Gloo's, which cross hosts at the link rate).
Example (about 10 min)::

    python -m gradzip.bench.validate --hosts 2 --ranks-per-node 2 --rates 100mbit --steps 24 \\
        --calibration-steps 12 --modes hierarchical flat --compressors none onebit:exchange=twophase
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gradzip.cluster import simulate as sim
from gradzip.netem import testbed
from gradzip.units import parse_bandwidth

LINK_EFFICIENCY = 1448 / 1514
PREFIX = "gzval"

PING = textwrap.dedent("""
    import socket, sys, time
    if sys.argv[1] == "server":
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((sys.argv[2], 5301)); s.listen(1); print("ready", flush=True)
        c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while (b := c.recv(64)):
            c.sendall(b)
    else:
        c = socket.create_connection((sys.argv[2], 5301), timeout=10)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(200):
            t = time.perf_counter(); c.sendall(b"x"); c.recv(64); rtts.append(time.perf_counter() - t)
        rtts.sort(); print(rtts[len(rtts) // 2])
""")


def measure_rtt(tb: testbed.Testbed, src: int = 0, dst: int = 1) -> float:
    """Median TCP round trip (1-byte ping-pong) from host ``src`` to host ``dst``, in seconds
    (``src == dst``: inside one host, over its loopback)."""
    ip = testbed.tool("ip")
    srv = subprocess.Popen([ip, "netns", "exec", tb.host_ns(dst), sys.executable, "-c", PING, "server",
                            tb.host_addr(dst)], stdout=subprocess.PIPE, text=True)
    try:
        srv.stdout.readline()  # type: ignore[union-attr]
        out = subprocess.run([ip, "netns", "exec", tb.host_ns(src), sys.executable, "-c", PING, "client",
                              tb.host_addr(dst)], capture_output=True, text=True, timeout=60, check=True).stdout
        return float(out.strip())
    finally:
        srv.kill()
        srv.wait()


def train(out: Path, hosts: int, rate: str, spec: str, args: argparse.Namespace, steps: int,
          hierarchical: bool = False) -> dict[str, Any]:
    """One ``gradzip train`` in the testbed (``args.ranks_per_node`` ranks per host, with
    ``--hierarchical`` if asked); the per-step records (after warm-up) and the summary."""
    cmd = [sys.executable, "-m", "gradzip", "train", "--backend", "gloo", "--netem", f"{hosts}:{rate}",
           "--model", args.model, "--compressor", spec, "--steps", str(steps), "--batch-size",
           str(args.batch_size), "--seq-len", str(args.seq_len), "--eval-batches", "0", "--checkpoint-every", "0",
           "--no-progress", "--out", str(out)]
    if args.ranks_per_node > 1:
        cmd += ["--ranks-per-node", str(args.ranks_per_node)]
    if hierarchical:
        cmd.append("--hierarchical")
    env = dict(os.environ, GRADZIP_NETEM_PREFIX=PREFIX, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    for attempt in (1, 2):  # one retry: a shared machine (another process rebuilding the data cache)
        shutil.rmtree(out, ignore_errors=True)
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.run_timeout)
        if p.returncode == 0:
            break
        print(f"attempt {attempt} of {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}", flush=True)
    else:
        raise RuntimeError(f"{' '.join(cmd)} failed twice")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r["step"] > args.warmup]
    summary = json.loads((out / "summary.json").read_text())
    return {"recs": recs, "summary": summary, "wall": time.perf_counter() - t0, "cmd": cmd}


def med(recs: list[dict[str, Any]], *keys: str) -> float:
    return statistics.median(sum(r[k] for k in keys) for r in recs)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m gradzip.bench.validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--rates", nargs="+", default=["25mbit", "50mbit", "100mbit"])
    ap.add_argument("--compressors", nargs="+", default=["none", "fp16", "topk:ratio=0.01,ef=true"])
    ap.add_argument("--calibration-rate", default="10gbit")
    ap.add_argument("--ranks-per-node", type=int, default=1, help="ranks on each emulated host (default 1)")
    ap.add_argument("--modes", nargs="+", choices=("flat", "hierarchical"), default=["flat"],
                    help="the engine's exchange: flat, --hierarchical, or both (default flat)")
    ap.add_argument("--intra-bandwidth", default="10gbit",
                    help="the predicted link between the ranks of one host (with --ranks-per-node > 1)")
    ap.add_argument("--model", default="bert-tiny")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--calibration-steps", type=int, default=None,
                    help="steps of each calibration run (default: --steps; compute keeps getting faster over "
                         "the first steps, so equal lengths compare like with like)")
    ap.add_argument("--warmup", type=int, default=4, help="first steps left out of the medians")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--run-timeout", type=float, default=300)
    ap.add_argument("--out", default=None, help="run directories (default: a temporary directory)")
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    ap.add_argument("--json", default=None, help="also write every number here")
    return ap


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = _parser()
    args = ap.parse_args(argv)
    args.calibration_steps = args.calibration_steps or args.steps
    if min(args.steps, args.calibration_steps) <= args.warmup:
        ap.error("--steps and --calibration-steps must exceed --warmup")
    if args.ranks_per_node < 1:
        ap.error("--ranks-per-node must be >= 1")
    for r in [*args.rates, args.intra_bandwidth]:
        parse_bandwidth(r)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    k = args.ranks_per_node
    root = Path(args.out or tempfile.mkdtemp(prefix="gradzip-validate-"))
    root.mkdir(parents=True, exist_ok=True)
    os.environ["GRADZIP_NETEM_PREFIX"] = PREFIX
    t_all = time.perf_counter()
    load = [os.getloadavg()[0]]
    tb, how = testbed.up(max(args.hosts), testbed.Shaping(parse_bandwidth(args.calibration_rate)), PREFIX)
    rows: list[dict[str, Any]] = []
    try:
        rtt = measure_rtt(tb)
        alpha = rtt / 2
        intra_alpha = measure_rtt(tb, 0, 0) / 2 if k > 1 else 0.0
        print(f"testbed {PREFIX}: {tb.hosts} hosts; TCP round trip {rtt * 1e6:.0f} us -> alpha {alpha * 1e6:.0f} us"
              + (f"; inside a host alpha {intra_alpha * 1e6:.0f} us" if k > 1 else ""), flush=True)
        configs = [(h, mode, spec) for h in args.hosts for mode in args.modes for spec in args.compressors]
        for hosts, mode, spec in configs:
            rows += _validate_config(root, hosts, mode, spec, args, alpha, intra_alpha)
    finally:
        if how == "created":
            testbed.down(PREFIX)
    table = markdown(rows, alpha, args, time.perf_counter() - t_all)
    print(table)
    if args.md:
        Path(args.md).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"alpha_s": alpha, "intra_alpha_s": intra_alpha,
                                               "load_average_1min": [*load, os.getloadavg()[0]], "rows": rows},
                                              indent=1))
    return 0


def _validate_config(root: Path, hosts: int, mode: str, spec: str, args: argparse.Namespace, alpha: float,
                     intra_alpha: float) -> list[dict[str, Any]]:
    """One calibration run of ``hosts`` hosts with ``spec`` in ``mode``, then one run per rate,
    each compared with the prediction: one row per rate."""
    k = args.ranks_per_node
    hier = mode == "hierarchical"
    tag = spec.replace(":", "-").replace(",", "-").replace("=", "")
    tag = (f"k{k}-" if k > 1 else "") + ("hier-" if hier else "") + tag
    cal = train(root / f"h{hosts}-{tag}-cal", hosts, args.calibration_rate, spec, args, args.calibration_steps, hier)
    compute = med(cal["recs"], "compute_s", "opt_s")
    compress = med(cal["recs"], "compress_s")
    print(f"calibration H={hosts}{f'x{k}' if k > 1 else ''}{' hierarchical' if hier else ''} {spec}: "
          f"compute+opt {compute * 1e3:.0f} ms, compress "
          f"{compress * 1e3:.0f} ms ({cal['wall']:.0f} s)", flush=True)
    rows = []
    for rate in args.rates:
        run = train(root / f"h{hosts}-{tag}-{rate}", hosts, rate, spec, args, args.steps, hier)
        row = _compare(hosts, mode, rate, spec, args, cal, run, alpha, intra_alpha)
        rows.append(row)
        print(f"H={hosts}{f'x{k}' if k > 1 else ''} {'hier ' if hier else ''}{rate:>8} {spec:<26} "
              f"measured {row['measured_step_s'] * 1e3:6.0f} ms  predicted "
              f"{row['predicted_step_s'] * 1e3:6.0f} ms  error {row['error']:+.1%} (same-run compute "
              f"{row['error_same_run_compute']:+.1%}, step-calibrated "
              f"{_pct(row['error_step_calibrated'], 1)})  wire overhead "
              f"{_pct(row['wire_overhead'])}  ({run['wall']:.0f} s)", flush=True)
    return rows


def _compare(hosts: int, mode: str, rate: str, spec: str, args: argparse.Namespace, cal: dict[str, Any],
             run: dict[str, Any], alpha: float, intra_alpha: float) -> dict[str, Any]:
    """The row of one run: what it measured against what ``gradzip simulate`` predicts for it from
    the calibration run ``cal``."""
    k, hier = args.ranks_per_node, mode == "hierarchical"
    compute = med(cal["recs"], "compute_s", "opt_s")
    compress = med(cal["recs"], "compress_s")
    s = run["summary"]
    work = sim.Workload(args.model, args.batch_size * args.seq_len / compute, args.batch_size,
                        args.seq_len, overlap=0.0, **({"hierarchical": True} if hier else {}))
    cl = sim.Cluster(hosts, k, parse_bandwidth(rate), parse_bandwidth(args.intra_bandwidth)
                     if k > 1 else 1e12, alpha, intra_alpha, "ring", LINK_EFFICIENCY)
    elems = sim.predict(spec, work, cl).detail["compressed_elements"] or 1
    codec = sim.CodecCost(compress / elems, 0.0, "calibration")
    p = sim.predict(spec, work, cl, codec)
    # Step-calibrated: the calibration's whole step, less its own predicted communication
    # and compression, stands for compute (so it includes the ranks' waits for each other).
    p_cal = sim.predict(spec, work, replace(cl, inter_bps=parse_bandwidth(args.calibration_rate)), codec)
    rest = med(cal["recs"], "step_s") - p_cal.exposed_comm_s - p_cal.compress_s
    p_step = sim.predict(spec, replace(work, tokens_per_second=args.batch_size * args.seq_len / rest),
                         cl, codec) if rest > 0 else None
    if p.params != s["params"]:
        raise RuntimeError(f"model sizes differ: simulate {p.params}, train {s['params']}")
    measured = med(run["recs"], "step_s")
    # the network model alone: this run's own compute and compression + predicted comm
    same_run = med(run["recs"], "compute_s", "opt_s", "compress_s") + p.exposed_comm_s
    return {"hosts": hosts, "ranks_per_node": k, "mode": mode, "rate": rate, "compressor": spec,
            "measured_step_s": measured,
            "predicted_step_s": p.step_s, "error": p.step_s / measured - 1,
            "error_same_run_compute": same_run / measured - 1,
            "predicted_step_s_step_calibrated": p_step.step_s if p_step else None,
            "error_step_calibrated": p_step.step_s / measured - 1 if p_step else None,
            "measured_comm_s": med(run["recs"], "comm_s"), "predicted_comm_s": p.exposed_comm_s,
            "compute_s": compute, "compress_s": compress,
            "calibration_step_s": med(cal["recs"], "step_s"), "bytes_per_step": s["bytes_per_step"],
            "predicted_sent_bytes": p.sent_bytes,
            "inter_bytes_per_step": s.get("inter_bytes_per_step"),
            "predicted_inter_bytes": getattr(p, "inter_bytes", None),
            "wire_bytes_per_step": s.get("wire_bytes_per_step"),
            "wire_overhead": s.get("wire_overhead"),
            "wire_frame_overhead": s.get("wire_frame_overhead"), "run_s": run["wall"]}


def _pct(v: float | None, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:+.{digits}%}"


def markdown(rows: list[dict[str, Any]], alpha: float, args: argparse.Namespace, total_s: float) -> str:
    """The table of ``rows``; with several ranks per host or hierarchical runs, also the layout
    (hosts × ranks, exchange) and the inter-host bytes per rank per step (measured by the engine,
    predicted, and on the wire)."""
    wide = any(r.get("ranks_per_node", 1) > 1 or r.get("mode", "flat") != "flat" for r in rows)
    head = "| hosts | rate | compressor | "
    rule = "|---|---|---|"
    if wide:
        head = "| hosts × ranks | exchange | rate | compressor | "
        rule = "|---|---|---|---|"
    head += ("measured step | predicted step | error | error, same-run compute | measured exposed comm | "
             "predicted comm | wire/accounted − 1 (tx_bytes; frames) |")
    rule += "---|---|---|---|---|---|---|"
    if wide:
        head += " predicted step, step-calibrated (error) | inter-host bytes/rank/step: engine, predicted, wire |"
        rule += "---|---|"
    out = [head, rule]
    for r in rows:
        lead = (f"| {r['hosts']} × {r.get('ranks_per_node', 1)} | {r.get('mode', 'flat')} | " if wide
                else f"| {r['hosts']} | ")
        line = (f"{lead}{r['rate']} | `{r['compressor']}` | {r['measured_step_s'] * 1e3:.0f} ms | "
                f"{r['predicted_step_s'] * 1e3:.0f} ms | {r['error']:+.1%} | {r['error_same_run_compute']:+.1%} | "
                f"{r['measured_comm_s'] * 1e3:.0f} ms | "
                f"{r['predicted_comm_s'] * 1e3:.0f} ms | {_pct(r['wire_overhead'])}; "
                f"{_pct(r['wire_frame_overhead'])} |")
        if wide:
            def mb(v: float | None) -> str:
                return "n/a" if v is None else f"{v / 1e6:.3f} MB"
            ps = r.get("predicted_step_s_step_calibrated")
            line += (f" {'n/a' if ps is None else f'{ps * 1e3:.0f} ms'} ({_pct(r.get('error_step_calibrated'), 1)}) |"
                     f" {mb(r.get('inter_bytes_per_step'))}, {mb(r.get('predicted_inter_bytes'))}, "
                     f"{mb(r.get('wire_bytes_per_step'))} |")
        out.append(line)
    errs = [abs(r["error"]) for r in rows]
    errs2 = [abs(r["error_same_run_compute"]) for r in rows]
    if errs:
        out.append(f"\n{len(rows)} configurations; |error| median {statistics.median(errs):.1%}, max {max(errs):.1%} "
                   f"(same-run compute: median {statistics.median(errs2):.1%}, max {max(errs2):.1%}); "
                   f"alpha {alpha * 1e6:.0f} us; {args.model}, batch {args.batch_size} x {args.seq_len} tokens, "
                   f"{args.steps} steps, {args.calibration_steps} for calibration (first {args.warmup} left out); "
                   f"total {total_s:.0f} s.")
        errs3 = [abs(r["error_step_calibrated"]) for r in rows if r.get("error_step_calibrated") is not None]
        if wide and errs3:
            out.append(f"Step-calibrated: |error| median {statistics.median(errs3):.1%}, max {max(errs3):.1%}.")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
