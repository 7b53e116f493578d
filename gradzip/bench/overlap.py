"""``gradzip bench overlap``: the wall time of a round of rare syncs on the network testbed, with and
without overlapped outer updates (``overlap=1``, :doc:`sync`'s "Overlapped outer updates").

For each ``--sync`` mode (``diloco``, ``sparseloco``, ...), each ``--every`` H and each of
``--repeats`` repeats, two ``gradzip train --backend gloo --netem HOSTS:RATE`` runs, one after the
other: ``MODE:every=H`` and ``MODE:every=H,overlap=1`` (``--threads 1`` per rank, no evaluation
or checkpoint on the way, ``--warmup-rounds`` + ``--rounds`` rounds of H steps). Needs root (the
testbed's namespaces, prefix ``--prefix``); the testbed is built once, for every run.

Per measured round (the warm-up rounds, the first of which holds the start-up, are left out), from
rank 0's ``metrics.jsonl``:

- ``wall_s``: real seconds of the round (``host_s`` at its sync step minus at the last one): the
  inner steps, the sync, and the loop's own work (the reduction of the metrics, the log);
- ``comm_s``: the wait for the exchange at the sync step. Without the overlap that is the exchange
  alone (nothing else runs while it travels); with it, what the round did not hide;
- ``compute_s`` = ``wall_s − comm_s``: everything the round does but wait for the exchange. The
  per-step reduction of the metrics paces rank 0 to the slower rank, so this is the round's
  compute on both ranks, as the exchange sees it;
- ``step_compute_s``: rank 0's own part of it, the sum over the H steps of ``step_s − comm_s``
  (forward, backward, inner steps, the sync's encode/decode and outer step); the rest
  (``loop_*_s`` in the cells) is the loop's own time, where a reduction of the metrics that
  queued behind the exchange in flight would show.

A run's value is the median over its rounds; a cell's, the median over the repeats. Each ``MODE``
and H gets: ``compute_s`` and ``exchange_s`` from the runs without the overlap, ``bound_s`` =
max(compute, exchange) and ``sum_s`` = compute + exchange, the two walls, and ``ratio`` = the
overlapped wall / bound (target: <= 1.1, within 10 % of max(compute, exchange)). On a machine
whose load changes between runs, ``ratio_own`` judges the overlapped runs against their own
compute: their wall / max(``compute_overlap_s``, exchange). Written:
``--json`` (every run's rounds, and the cells) and ``--figure`` (PNG: wall time per round against
H, with and without the overlap, and both references). ``--from-json FILE`` runs nothing: it
recomputes the cells, the table and the figure from the runs an earlier JSON holds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gradzip.errors import GradzipError
from gradzip.io import atomic_write_json
from gradzip.netem import testbed
from gradzip.netem.spec import parse_netem
from gradzip.training.launch import testbed_for

TARGET = 1.1  # the overlapped round within 10 % of max(compute, exchange)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sync", nargs="+", default=["diloco"], metavar="MODE",
                        help="rare-sync modes, each with its options but every= and overlap= (default: diloco)")
    parser.add_argument("--every", nargs="+", type=int, default=[2, 6, 12], metavar="H",
                        help="inner steps per round (default: 2 6 12)")
    parser.add_argument("--netem", default="2:100mbit", metavar="HOSTS:RATE[:DELAY[:LOSS%%]]",
                        help="the testbed (default: 2:100mbit)")
    parser.add_argument("--model", default="bert-tiny", help="BERT size (default: bert-tiny)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step and rank (default: 8)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: 64)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per run (default: 5)")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds left out first (default: 1)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant (default: 3)")
    parser.add_argument("--out", default="bench-overlap", help="directory of the runs (default: bench-overlap)")
    parser.add_argument("--json", default=None, metavar="FILE", help="results (default: OUT/overlap_testbed.json)")
    parser.add_argument("--figure", default=None, metavar="FILE.png",
                        help="the figure (default: OUT/overlap_testbed.png)")
    parser.add_argument("--prefix", default="gzbench", help="testbed prefix (default: gzbench)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run (default: 600)")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="run nothing: recompute the cells, the table and the figure from the runs in an "
                             "earlier run's JSON, and rewrite it (no testbed, no root)")


def _check(args: argparse.Namespace) -> None:
    """Bad input: a GradzipError (one line, exit 2) before anything runs or is written."""
    for flag, values in (("--every", args.every), ("--rounds", [args.rounds]), ("--repeats", [args.repeats]),
                         ("--batch-size", [args.batch_size]), ("--seq-len", [args.seq_len])):
        if any(v < 1 for v in values):
            raise GradzipError(f"{flag} must be >= 1, got {' '.join(map(str, values))}")
    if args.warmup_rounds < 1:
        raise GradzipError(f"--warmup-rounds must be >= 1 (the first round holds the start-up), "
                           f"got {args.warmup_rounds}")
    for mode in args.sync:
        if any(k in mode for k in ("every=", "overlap=")):
            raise GradzipError(f"--sync {mode!r}: leave every= and overlap= out (the benchmark sets them)")
    if parse_netem(args.netem).hosts < 2:
        raise GradzipError(f"--netem {args.netem!r}: the exchange needs at least 2 hosts")
    testbed.validate_prefix(args.prefix)
    if Path(args.out).is_dir() and any(Path(args.out).iterdir()):
        raise GradzipError(f"--out {args.out!r} is not empty (runs of an earlier bench?); choose another --out "
                           "or remove it")
    if args.figure is not None and not args.figure.endswith(".png"):
        raise GradzipError(f"--figure must name a .png file, got {args.figure!r}")


def sync_spec(mode: str, every: int, overlap: bool) -> str:
    """``MODE[:opts]`` with ``every=H`` (and ``overlap=1``) added."""
    name, _, opts = mode.partition(":")
    parts = [p for p in opts.split(",") if p] + [f"every={every}"] + (["overlap=1"] if overlap else [])
    return f"{name}:{','.join(parts)}"


def measure_rounds(rows: list[dict[str, Any]], every: int, warmup: int) -> list[dict[str, float]]:
    """The measured rounds of one run (see the module docstring) from its metrics rows: round k (from 1)
    ends at step k·H; rounds 1..``warmup`` are left out."""
    by_step = {int(r["step"]): r for r in rows}
    last = max(by_step) // every
    out = []
    for k in range(warmup + 1, last + 1):
        steps = [by_step[s] for s in range((k - 1) * every + 1, k * every + 1)]
        end, start = by_step[k * every], by_step[(k - 1) * every]
        wall = end["host_s"] - start["host_s"]
        out.append({"round": k, "wall_s": wall, "comm_s": end["comm_s"], "compute_s": wall - end["comm_s"],
                    "step_compute_s": sum(r["step_s"] - r["comm_s"] for r in steps), "bytes_sent": end["bytes_sent"]})
    return out


def _median(runs: list[dict[str, Any]], key: str) -> float:
    """Median over the runs of each run's median over its rounds; ``loop_s``: compute − step compute."""
    def value(r: dict[str, Any]) -> float:
        return r["compute_s"] - r["step_compute_s"] if key == "loop_s" else r[key]

    return statistics.median(statistics.median(value(r) for r in run["rounds"]) for run in runs)


def cells(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mode, H): the medians of the module docstring and the verdict."""
    rows = []
    for mode, every in dict.fromkeys((r["sync"], r["every"]) for r in runs):
        plain = [r for r in runs if (r["sync"], r["every"], r["overlap"]) == (mode, every, False)]
        over = [r for r in runs if (r["sync"], r["every"], r["overlap"]) == (mode, every, True)]
        compute, exchange = _median(plain, "compute_s"), _median(plain, "comm_s")
        bound, wall = max(compute, exchange), _median(over, "wall_s")
        rows.append({"sync": mode, "every": every, "compute_s": compute, "exchange_s": exchange,
                     "bound_s": bound, "sum_s": compute + exchange, "wall_no_overlap_s": _median(plain, "wall_s"),
                     "wall_overlap_s": wall, "compute_overlap_s": _median(over, "compute_s"),
                     "step_compute_s": _median(plain, "step_compute_s"),
                     "loop_no_overlap_s": _median(plain, "loop_s"), "loop_overlap_s": _median(over, "loop_s"),
                     "wait_overlap_s": _median(over, "comm_s"), "ratio": wall / bound,
                     "ratio_own": wall / max(_median(over, "compute_s"), exchange),
                     "target_met": wall <= TARGET * bound, "repeats": min(len(plain), len(over))})
    return rows


def _train(args: argparse.Namespace, mode: str, every: int, overlap: bool, out: Path) -> list[dict[str, Any]]:
    """One run on the testbed; its metrics rows (rank 0)."""
    steps = (args.warmup_rounds + args.rounds) * every
    cmd = [sys.executable, "-m", "gradzip", "train", "--backend", "gloo", "--netem", args.netem,
           "--model", args.model, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--sync", sync_spec(mode, every, overlap), "--steps", str(steps),
           "--threads", "1", "--eval-batches", "0", "--checkpoint-every", "0", "--no-progress", "--out", str(out)]
    env = {**os.environ, "GRADZIP_NETEM_PREFIX": args.prefix, "OMP_NUM_THREADS": "1"}
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        raise GradzipError(f"bench overlap: `{' '.join(cmd)}` took over {args.timeout:g} s") from None
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise GradzipError(f"bench overlap: `{' '.join(cmd)}` failed (exit {p.returncode}): {tail}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def figure(rows: list[dict[str, Any]], path: Path, netem: str) -> None:
    """Wall time per round against H, with and without the overlap, beside compute + exchange and
    max(compute, exchange) (the band: up to 10 % above it); one panel per mode."""
    from gradzip.plots import style

    modes = list(dict.fromkeys(r["sync"] for r in rows))
    fig, axes = style.new_figure(ncols=len(modes), sharey=False)
    for ax, mode in zip(axes, modes):
        mine = [r for r in rows if r["sync"] == mode]
        h = [r["every"] for r in mine]
        bound = [r["bound_s"] for r in mine]
        ax.fill_between(h, bound, [TARGET * b for b in bound], color="0.85", label="target: max + 10 %")
        ax.plot(h, [r["sum_s"] for r in mine], "k:", label="compute + exchange")
        ax.plot(h, bound, "k--", label="max(compute, exchange)")
        ax.plot(h, [r["wall_no_overlap_s"] for r in mine], "o-", label="wall, no overlap")
        ax.plot(h, [r["wall_overlap_s"] for r in mine], "s-", label="wall, overlap=1")
        ax.plot(h, [r["compute_overlap_s"] for r in mine], "x", color="0.4", label="compute, overlap=1 runs")
        ax.set_xticks(h)
        ax.set_xlabel("H (inner steps per round)")
        ax.set_ylabel("seconds per round")
        ax.set_title(f"{mode}, gloo, testbed {netem}")
        style.legend(ax, loc="upper left")
    path.parent.mkdir(parents=True, exist_ok=True)
    with style.plt.rc_context(style.RC):
        fig.tight_layout()
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, format="png")
        tmp.replace(path)
    style.plt.close(fig)


def _print(rows: list[dict[str, Any]]) -> None:
    print(f"{'sync':<12} {'H':>3} {'compute':>8} {'exchange':>8} {'max':>7} {'sum':>7} {'wall':>7} "
          f"{'wall ovl':>8} {'ovl/max':>7} {'own':>5}  target")
    for r in rows:
        print(f"{r['sync']:<12} {r['every']:>3} {r['compute_s']:>8.3f} {r['exchange_s']:>8.3f} {r['bound_s']:>7.3f} "
              f"{r['sum_s']:>7.3f} {r['wall_no_overlap_s']:>7.3f} {r['wall_overlap_s']:>8.3f} {r['ratio']:>7.2f} "
              f"{r['ratio_own']:>5.2f}  "
              f"{'met' if r['target_met'] else 'missed'}")


def _again(args: argparse.Namespace) -> int:
    """``--from-json``: the cells, table and figure again from the runs that FILE holds."""
    path = Path(args.from_json)
    if args.figure is not None and not args.figure.endswith(".png"):
        raise GradzipError(f"--figure must name a .png file, got {args.figure!r}")
    try:
        result = json.loads(path.read_text())
        result["cells"] = cells(result["runs"])
    except (OSError, ValueError, KeyError, TypeError, statistics.StatisticsError) as e:
        raise GradzipError(f"--from-json {args.from_json!r}: not a JSON that `gradzip bench overlap` wrote "
                           f"({type(e).__name__}: {e})") from None
    atomic_write_json(Path(args.json) if args.json else path, result)
    figure(result["cells"], Path(args.figure) if args.figure else path.with_suffix(".png"), result["netem"])
    _print(result["cells"])
    return 0


def run(args: argparse.Namespace) -> int:
    if args.from_json is not None:
        return _again(args)
    _check(args)
    testbed.check_privileges()  # not root: one line, exit 2
    out = Path(args.out)
    json_path = Path(args.json) if args.json else out / "overlap_testbed.json"
    fig_path = Path(args.figure) if args.figure else out / "overlap_testbed.png"
    runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with testbed_for(parse_netem(args.netem), args.prefix):
        for mode in args.sync:
            for every in args.every:
                for rep in range(args.repeats):
                    for overlap in (False, True):  # interleaved: both variants see the same neighbours
                        name = f"{mode.partition(':')[0]}-H{every}-{'overlap' if overlap else 'plain'}-{rep}"
                        rows = _train(args, mode, every, overlap, out / name)
                        runs.append({"sync": mode, "every": every, "overlap": overlap, "repeat": rep,
                                     "spec": sync_spec(mode, every, overlap),
                                     "rounds": measure_rounds(rows, every, args.warmup_rounds)})
                        print(f"  {name}: wall {statistics.median(r['wall_s'] for r in runs[-1]['rounds']):.3f} s "
                              "per round", file=sys.stderr, flush=True)
    rows = cells(runs)
    result = {"netem": args.netem, "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "backend": "gloo", "threads_per_rank": 1,
              "rounds": args.rounds, "warmup_rounds": args.warmup_rounds, "repeats": args.repeats,
              "target_ratio": TARGET, "cpu_count": os.cpu_count(), "seconds": time.perf_counter() - t0,
              "cells": rows, "runs": runs}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(json_path, result)
    figure(rows, fig_path, args.netem)
    _print(rows)
    print(f"wrote {json_path} and {fig_path}")
    return 0
