"""Validate ``gradzip simulate`` against real training in the network testbed.

``python -m gradzip.bench.validate [--hosts 2 3] [--rates 25mbit 50mbit 100mbit]
[--compressors none fp16 topk:ratio=0.01,ef=true] [--syncs step diloco:every=8] [--steps 10] [--md FILE]``
(root; ~10 min on 2 cores)

For every host count H, exchange mode, ``--sync`` S and compressor C (a compressor spec, exchange
scheme included: ``onebit:exchange=twophase``, ``topk:ratio=0.01,ef=true,exchange=sparse``; the
prediction is for the same spec, so for the same scheme):

1. calibration: ``gradzip train --backend gloo --netem H:10gbit --sync S`` (``--calibration-steps``
   steps) — the network is not the bottleneck; its per-step ``compute_s + opt_s`` and
   ``compress_s`` (this machine's measured compute and encode/decode time for H ranks sharing its
   cores) calibrate the model;
2. for every rate R: ``gradzip train --backend gloo --netem H:R --sync S``, measured step time
   from ``step_s`` over the steps after the first ``--warmup``;
3. prediction: :func:`gradzip.cluster.simulate.predict` for H nodes × 1 GPU, bandwidth R, sync S,
   link efficiency 1448/1514 (TCP/IPv4 with timestamps over Ethernet, MTU 1500: the shaper
   counts every frame's headers), α = half the testbed's measured TCP round trip, overlap 0 (with
   bert-tiny every bucket is ready only at the end of backward), compute and compression from (1).

Per-step exchange (``--sync step``): every quantity is the median over the steps after warm-up;
the measured compression time is spread over the model's encode and decode terms so that
``predict()`` charges exactly it at the calibration's rank count (twophase's server re-encode and
gTop-k's merges included). Outer modes (``--sync diloco:every=H,...``, ``localsgd:every=H``): a
step either only computes or also syncs, so medians would drop the syncs: every quantity is the
mean over the last whole periods after warm-up (the largest multiple of H steps; any H consecutive
steps send each fragment once). Compute is the inner steps' ``compute_s + opt_s`` (the engine
measures it before the sync); the calibration's ``compress_s`` per period (pseudo-gradient,
encode/decode, outer step and merge: all the sync's work on the compute thread) is charged as
the outer step's local work (``predict(memory_bps=...)`` set so that it equals the measurement;
it scales with each fragment's parameters). The rows add the sync's cost per period, H × (mean
step − mean compute), measured and predicted (``Prediction.sync_exposed_s``).

Error = predicted / measured − 1, per configuration. A second error replaces the calibration's
compute and compression by the run's own measured ones, so that it isolates the network model
(on a shared machine, compute time drifts between runs). A third, step-calibrated, takes for
compute the calibration run's step time less its own predicted communication and compression: it
then includes the time the ranks wait for each other, which the model has no term for and which
dominates when more ranks than cores share the machine.

Several ranks per host: ``--ranks-per-node K`` runs every configuration with K ranks on each
emulated host (``gradzip train --ranks-per-node K``: H × K ranks, the ranks of a host talk over
its loopback), and ``--modes flat hierarchical`` runs each compressor with the flat exchange, with
``--hierarchical``, or both (calibrated separately). The prediction is then for H nodes × K GPUs:
inter-node bandwidth R, intra-node bandwidth ``--intra-bandwidth`` (default 10gbit) and latency
half the TCP round trip inside a host, ``Workload(hierarchical=True)`` for the hierarchical runs
(flat runs: ring collectives in rank order, as Gloo's, which cross hosts at the link rate).
Examples (about 10 min each)::

    python -m gradzip.bench.validate --hosts 2 --ranks-per-node 2 --rates 100mbit --steps 24 \\
        --calibration-steps 12 --modes hierarchical flat --compressors none onebit:exchange=twophase
    python -m gradzip.bench.validate --hosts 2 --rates 100mbit --steps 24 --warmup 8 \\
        --compressors none --syncs diloco:every=8 diloco:every=8,fragments=2
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

from gradzip.bench.validate_table import markdown, pct
from gradzip.cluster import simulate as sim
from gradzip.errors import SpecError
from gradzip.netem import testbed
from gradzip.plan.sync import SyncSpec, parse_sync
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
          hierarchical: bool = False, sync: str = "step") -> dict[str, Any]:
    """One ``gradzip train --sync sync`` in the testbed (``args.ranks_per_node`` ranks per host,
    with ``--hierarchical`` if asked); every per-step record and the summary."""
    cmd = [sys.executable, "-m", "gradzip", "train", "--backend", "gloo", "--netem", f"{hosts}:{rate}",
           "--model", args.model, "--compressor", spec, "--sync", sync, "--steps", str(steps), "--batch-size",
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
    summary = json.loads((out / "summary.json").read_text())
    return {"recs": recs, "summary": summary, "wall": time.perf_counter() - t0, "cmd": cmd}


# ------------------------------------------------------------------ measurement and prediction arithmetic
def period(sync: str | SyncSpec) -> int:
    """Steps per sync period: H for the outer modes, 1 for ``step``."""
    s = parse_sync(sync)
    return s.every if s.outer else 1


def window(recs: list[dict[str, Any]], warmup: int, every: int = 1) -> list[dict[str, Any]]:
    """The records measured: those after step ``warmup``, less the first few so that their count is
    a multiple of ``every`` (whole sync periods; any ``every`` consecutive steps sync each fragment
    once)."""
    after = sorted((r for r in recs if r["step"] > warmup), key=lambda r: r["step"])
    keep = len(after) // every * every
    if keep == 0:
        raise ValueError(f"{len(after)} steps after warm-up {warmup}: fewer than one sync period of {every}")
    return after[len(after) - keep:]


def measure(recs: list[dict[str, Any]], warmup: int, sync: str | SyncSpec = "step") -> dict[str, float]:
    """What a run measured, per step: ``step_s``, ``compute_s`` (compute + optimizer), ``compress_s``,
    ``comm_s`` (exposed), ``own_s`` (compute + optimizer + compression) — medians for ``step``,
    means over whole periods for the outer modes — ``sync_cost_s`` (per period: H × (step − compute)),
    ``host_step_s`` (host time per step over the same steps: also counts what ``step_s`` leaves
    out) and ``steps`` (how many)."""
    every = period(sync)
    w = window(recs, warmup, every)
    agg = statistics.fmean if parse_sync(sync).outer else statistics.median

    def of(*keys: str) -> float:
        return agg([sum(r[k] for k in keys) for r in w])

    m = {"step_s": of("step_s"), "compute_s": of("compute_s", "opt_s"), "compress_s": of("compress_s"),
         "comm_s": of("comm_s"), "own_s": of("compute_s", "opt_s", "compress_s"), "steps": float(len(w))}
    m["sync_cost_s"] = every * (m["step_s"] - m["compute_s"])
    before = [r for r in recs if r["step"] == w[0]["step"] - 1]
    if before and all("host_s" in r for r in (before[0], w[-1])):
        m["host_step_s"] = (w[-1]["host_s"] - before[0]["host_s"]) / len(w)
    return m


def calibrate_codec(spec: str, sync: str | SyncSpec, work: sim.Workload, cl: sim.Cluster,
                    compress_s: float) -> tuple[sim.CodecCost, float | None]:
    """(codec cost, memory bandwidth for ``predict``) such that the predicted compression time
    per step at ``cl``'s rank count equals the measured ``compress_s``. Per-step exchange: one cost
    per element for encode and for decode, scaled to the model's terms (encode, scheme work between
    rounds, decode). Outer modes: the whole sync's local work as the outer step's
    (``OUTER_ACCESSES`` fp32 accesses per parameter at the returned bandwidth), no codec."""
    s = parse_sync(sync)
    if compress_s <= 0:
        return sim.CodecCost(), None
    if s.outer:
        params = sim.predict(spec, work, cl, sync=s).params
        return sim.CodecCost(), sim.OUTER_ACCESSES * 4 * params * 8 / (compress_s * s.every)
    unit = sim.predict(spec, work, cl, sim.CodecCost(1.0, 1.0)).compress_s
    if unit <= 0:  # nothing compressed (plain `none`): nothing to charge it to
        return sim.CodecCost(), None
    return sim.CodecCost(compress_s / unit, compress_s / unit, "calibration"), None


def cluster(hosts: int, rate: str, args: argparse.Namespace, alpha: float, intra_alpha: float) -> sim.Cluster:
    """The testbed as ``predict`` sees it: ``hosts`` nodes of ``--ranks-per-node`` GPUs at ``rate``."""
    k = args.ranks_per_node
    return sim.Cluster(hosts, k, parse_bandwidth(rate), parse_bandwidth(args.intra_bandwidth) if k > 1 else 1e12,
                       alpha, intra_alpha, "ring", LINK_EFFICIENCY)


def predictions(spec: str, sync: str, hier: bool, cl: sim.Cluster, cal_cl: sim.Cluster, cal: dict[str, float],
                args: argparse.Namespace) -> tuple[sim.Prediction, sim.Prediction | None]:
    """(calibrated prediction, step-calibrated prediction or None) for ``cl`` from the calibration
    measurement ``cal`` (:func:`measure`) made on ``cal_cl``. Step-calibrated: the calibration's
    whole step, less its own predicted communication and compression, stands for compute (so it
    includes the ranks' waits for each other)."""
    tokens = args.batch_size * args.seq_len
    work = sim.Workload(args.model, tokens / cal["compute_s"], args.batch_size, args.seq_len, overlap=0.0,
                        hierarchical=hier)
    codec, mem = calibrate_codec(spec, sync, work, cal_cl, cal["compress_s"])
    p = sim.predict(spec, work, cl, codec, sync=sync, memory_bps=mem)
    p_cal = sim.predict(spec, work, cal_cl, codec, sync=sync, memory_bps=mem)
    rest = cal["step_s"] - (p_cal.step_s - p_cal.compute_s)
    if rest <= 0:
        return p, None
    return p, sim.predict(spec, replace(work, tokens_per_second=tokens / rest), cl, codec, sync=sync, memory_bps=mem)


def compare(measured: dict[str, float], p: sim.Prediction, p_step: sim.Prediction | None,
            every: int) -> dict[str, Any]:
    """The errors of one run: predicted / measured − 1 of the step (calibrated, same-run compute:
    the run's own compute and compression plus the predicted exposed communication, and
    step-calibrated) and of the sync's cost per period."""
    step = measured["step_s"]
    same_run = measured["own_s"] + p.exposed_comm_s
    sync_cost = every * (p.step_s - p.compute_s)
    return {"measured_step_s": step, "predicted_step_s": p.step_s, "error": p.step_s / step - 1,
            "error_same_run_compute": same_run / step - 1,
            "predicted_step_s_step_calibrated": p_step.step_s if p_step else None,
            "error_step_calibrated": p_step.step_s / step - 1 if p_step else None,
            "measured_comm_s": measured["comm_s"], "predicted_comm_s": p.exposed_comm_s,
            "measured_sync_cost_s": measured["sync_cost_s"], "predicted_sync_cost_s": sync_cost,
            "error_sync_cost": sync_cost / measured["sync_cost_s"] - 1 if measured["sync_cost_s"] > 0 else None}


# ------------------------------------------------------------------ command line
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m gradzip.bench.validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--rates", nargs="+", default=["25mbit", "50mbit", "100mbit"])
    ap.add_argument("--compressors", nargs="+", default=["none", "fp16", "topk:ratio=0.01,ef=true"],
                    help="compressor specs, exchange scheme included (e.g. onebit:exchange=twophase, "
                         "topk:ratio=0.01,ef=true,exchange=sparse)")
    ap.add_argument("--syncs", nargs="+", default=["step"],
                    help="gradzip train --sync specs, each run with every compressor (e.g. step diloco:every=8 "
                         "diloco:every=8,fragments=2; default step)")
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
    ap.add_argument("--warmup", type=int, default=4, help="first steps left out of the measurement")
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
    syncs = []
    for text in args.syncs:
        try:
            s = parse_sync(text)
        except SpecError as e:
            ap.error(str(e))
        every = period(s)
        if min(args.steps, args.calibration_steps) - args.warmup < every:
            ap.error(f"--sync {text}: --steps and --calibration-steps must leave at least one period of {every} "
                     f"steps after --warmup {args.warmup} (better several, and --warmup a multiple of {every})")
        syncs.append("step" if not s.outer else text)
    args.syncs = syncs
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
        configs = [(h, mode, sync, spec) for h in args.hosts for mode in args.modes for sync in args.syncs
                   for spec in args.compressors]
        for hosts, mode, sync, spec in configs:
            rows += _validate_config(root, hosts, mode, sync, spec, args, alpha, intra_alpha)
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


def _tag(k: int, hier: bool, sync: str, spec: str) -> str:
    """A directory name for one configuration."""
    def clean(t: str) -> str:
        return t.replace(":", "-").replace(",", "-").replace("=", "")
    return ((f"k{k}-" if k > 1 else "") + ("hier-" if hier else "") + ("" if sync == "step" else clean(sync) + "-")
            + clean(spec))


def _validate_config(root: Path, hosts: int, mode: str, sync: str, spec: str, args: argparse.Namespace,
                     alpha: float, intra_alpha: float) -> list[dict[str, Any]]:
    """One calibration run of ``hosts`` hosts with ``spec`` and ``sync`` in ``mode``, then one run
    per rate, each compared with the prediction: one row per rate."""
    k = args.ranks_per_node
    hier = mode == "hierarchical"
    tag = _tag(k, hier, sync, spec)
    what = f"H={hosts}{f'x{k}' if k > 1 else ''}{' hier' if hier else ''}{'' if sync == 'step' else ' ' + sync}"
    cal = train(root / f"h{hosts}-{tag}-cal", hosts, args.calibration_rate, spec, args, args.calibration_steps,
                hier, sync)
    cal_m = measure(cal["recs"], args.warmup, sync)
    print(f"calibration {what} {spec}: compute+opt {cal_m['compute_s'] * 1e3:.0f} ms, compress "
          f"{cal_m['compress_s'] * 1e3:.0f} ms, step {cal_m['step_s'] * 1e3:.0f} ms ({cal['wall']:.0f} s)", flush=True)
    rows = []
    for rate in args.rates:
        run = train(root / f"h{hosts}-{tag}-{rate}", hosts, rate, spec, args, args.steps, hier, sync)
        row = _row(hosts, mode, sync, rate, spec, args, cal, cal_m, run, alpha, intra_alpha)
        rows.append(row)
        print(f"{what} {rate:>8} {spec:<26} measured {row['measured_step_s'] * 1e3:6.0f} ms  predicted "
              f"{row['predicted_step_s'] * 1e3:6.0f} ms  error {row['error']:+.1%} (same-run compute "
              f"{row['error_same_run_compute']:+.1%}, step-calibrated "
              f"{pct(row['error_step_calibrated'], 1)}, sync cost {pct(row['error_sync_cost'], 1)})  wire overhead "
              f"{pct(row['wire_overhead'])}  ({run['wall']:.0f} s)", flush=True)
    return rows


def _row(hosts: int, mode: str, sync: str, rate: str, spec: str, args: argparse.Namespace, cal: dict[str, Any],
         cal_m: dict[str, float], run: dict[str, Any], alpha: float, intra_alpha: float) -> dict[str, Any]:
    """The row of one run: what it measured against what ``gradzip simulate`` predicts for it from
    the calibration run ``cal`` (measured: ``cal_m``)."""
    s = run["summary"]
    cl = cluster(hosts, rate, args, alpha, intra_alpha)
    cal_cl = replace(cl, inter_bps=parse_bandwidth(args.calibration_rate))
    p, p_step = predictions(spec, sync, mode == "hierarchical", cl, cal_cl, cal_m, args)
    if p.params != s["params"]:
        raise RuntimeError(f"model sizes differ: simulate {p.params}, train {s['params']}")
    if s.get("exchange", p.exchange) != p.exchange:
        print(f"warning: {spec}: simulate's exchange {p.exchange}, train's {s['exchange']}", flush=True)
    m = measure(run["recs"], args.warmup, sync)
    return {"hosts": hosts, "ranks_per_node": args.ranks_per_node, "mode": mode, "sync": sync, "rate": rate,
            "compressor": spec, "exchange": p.exchange, "train_exchange": s.get("exchange"),
            **compare(m, p, p_step, period(sync)),
            "measured_steps": m["steps"], "measured_host_step_s": m.get("host_step_s"),
            "compute_s": cal_m["compute_s"], "compress_s": cal_m["compress_s"],
            "calibration_step_s": cal_m["step_s"], "bytes_per_step": s["bytes_per_step"],
            "predicted_sent_bytes": p.sent_bytes,
            "inter_bytes_per_step": s.get("inter_bytes_per_step"),
            "predicted_inter_bytes": getattr(p, "inter_bytes", None),
            "wire_bytes_per_step": s.get("wire_bytes_per_step"),
            "wire_overhead": s.get("wire_overhead"),
            "wire_frame_overhead": s.get("wire_frame_overhead"), "run_s": run["wall"],
            "calibration_run_s": cal["wall"]}


if __name__ == "__main__":
    sys.exit(main())
