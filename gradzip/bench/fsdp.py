"""``gradzip bench fsdp``: :func:`gradzip.fsdp_compress` inside FSDP2 (``fully_shard``) on Gloo.

``--workers`` local Gloo ranks each build BERT (``--model mini``; a small vocabulary and short
sequences so that it runs in about a minute on a laptop), one ``fully_shard`` per encoder layer
then the root, one copy per configuration. Interleaved round by round (so that load changes hit
every configuration alike), each step after a barrier, forward + backward + optimizer step:

- ``fsdp2`` (plain FSDP2) against ``none`` (gradzip's reduce-scatter, fp32): the overhead of the
  hook, target <= 1.05x;
- each ``--compressor``: its step time and the bytes this rank sent through gradzip per step
  (``bytes_sent`` delta), against ``none``'s (the fp32 payload).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradzip.bench.engine import make_batch
from gradzip.comm import init_communicator, spawn_local
from gradzip.compress import create
from gradzip.errors import GradzipError, SpecError
from gradzip.models import bert_config
from gradzip.models.bert import BertForPreTraining

TARGET = 1.05
DEFAULT_COMPRESSORS = ["fp16", "onebit", "topk:ratio=0.01,ef=true"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4, help="Gloo processes (default: 4)")
    parser.add_argument("--model", default="mini", help="BERT size: tiny, mini, ... (default: mini)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration (default: 20)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default: 2)")
    parser.add_argument("--compressor", nargs="+", action="extend", metavar="SPEC",
                        help="compressors compared with none, one or more per flag, the flag repeatable "
                             "(default: fp16 onebit topk:ratio=0.01,ef=true)")
    # Named as gradzip train's flags; the short old names stay as aliases.
    parser.add_argument("--batch-size", "--batch", dest="batch", type=int, default=8, metavar="N",
                        help="sequences per worker (default: 8)")
    parser.add_argument("--seq-len", "--seq", dest="seq", type=int, default=64, metavar="N",
                        help="sequence length (default: 64)")
    parser.add_argument("--vocab-size", "--vocab", dest="vocab", type=int, default=2048, metavar="N",
                        help="vocabulary size (default: 2048)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    parser.add_argument("--_worker", help=argparse.SUPPRESS)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    full = args.model if args.model.startswith("bert-") else f"bert-{args.model}"
    cfg = bert_config(full, vocab_size=args.vocab, max_position_embeddings=max(args.seq, 128),
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return BertForPreTraining(cfg)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """One FSDP module per encoder layer, then the root (the layout the docs recommend)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.bert.encoder.layer:  # type: ignore[union-attr]
        fully_shard(layer)
    fully_shard(model)
    return model


def check_compressor(spec: str) -> None:
    """An unknown compressor or a bad option, refused here, before any rank starts."""
    try:
        create(spec)
    except SpecError as e:
        raise GradzipError(str(e)) from None


# ------------------------------------------------------------------ one rank
def _rank_main(args: argparse.Namespace) -> int:
    from gradzip.engine.fsdp import fsdp_compress

    torch.set_num_threads(1)
    comm = init_communicator("gloo", timeout=600.0)
    rank = comm.rank
    names = ["fsdp2", "none", *[c for c in args.compressor if c != "none"]]  # none: always, once
    proto = build_model(args)
    batch = make_batch(proto, args.batch, args.seq, seed=rank)
    models, opts, comps = {}, {}, {}
    for name in names:
        m = build_model(args)
        m.load_state_dict(proto.state_dict())
        models[name] = shard(m)
        opts[name] = torch.optim.AdamW(m.parameters(), lr=1e-4)
        comps[name] = None if name == "fsdp2" else fsdp_compress(m, name, timeout=300.0)

    def step(name: str) -> tuple[float, int]:
        comp = comps[name]
        before = comp.bytes_sent if comp is not None else 0
        dist.barrier()
        t0 = time.perf_counter()
        opts[name].zero_grad(set_to_none=True)
        models[name](**batch).loss.backward()
        opts[name].step()
        dt = time.perf_counter() - t0
        return dt, (comp.bytes_sent - before) if comp is not None else 0

    for name in names:  # warm-up: allocations, optimizer state
        step(name)
    times: dict[str, list[float]] = {k: [] for k in names}
    sent: dict[str, list[int]] = {k: [] for k in names}
    per_round = max(1, -(-args.steps // args.rounds))
    for r in range(args.rounds):
        k = min(per_round, args.steps - r * per_round)
        for name in names:
            for _ in range(k):
                dt, b = step(name)
                times[name].append(dt)
                sent[name].append(b)
    if rank == 0:
        out = {"workers": comm.world_size, "params": sum(p.numel() for p in proto.parameters()),
               "times": times, "bytes": sent}
        Path(args._worker, "rank0.json").write_text(json.dumps(out))
    for c in comps.values():
        if c is not None:
            c.remove()
    dist.barrier()
    comm.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------ entry point
def _validate(args: argparse.Namespace) -> None:
    if args.workers < 2 or args.steps < 1 or args.rounds < 1:
        raise GradzipError(f"--workers must be >= 2 and --steps/--rounds >= 1 (got {args.workers}, {args.steps}, "
                           f"{args.rounds})")
    if args.batch < 1 or args.seq < 2 or args.vocab < 16:
        raise GradzipError(f"--batch-size must be >= 1, --seq-len >= 2, --vocab-size >= 16 (got {args.batch}, "
                           f"{args.seq}, {args.vocab})")
    try:
        build_model(args)
    except (KeyError, ValueError) as e:
        raise GradzipError(f"--model: {e}") from None
    args.compressor = args.compressor or list(DEFAULT_COMPRESSORS)
    for spec in args.compressor:
        try:
            check_compressor(spec)
        except GradzipError as e:
            raise GradzipError(f"--compressor {spec}: {e}") from None


def run(args: argparse.Namespace) -> int:
    if args._worker:
        return _rank_main(args)
    _validate(args)
    with tempfile.TemporaryDirectory(prefix="gradzip-bench-fsdp-") as tmp:
        argv = ["bench", "fsdp", "--_worker", tmp, "--model", args.model, "--steps", str(args.steps),
                "--rounds", str(args.rounds), "--batch-size", str(args.batch), "--seq-len", str(args.seq),
                "--vocab-size", str(args.vocab), "--compressor", *args.compressor]
        t0 = time.perf_counter()
        rc = spawn_local("gloo", args.workers, argv, env_extra={"OMP_NUM_THREADS": "1"}, timeout=3600)
        if rc != 0:
            raise GradzipError(f"benchmark workers failed (exit code {rc}); see their output above")
        real = json.loads(Path(tmp, "rank0.json").read_text())
        wall = time.perf_counter() - t0
    out = {"meta": {"workers": real["workers"], "model": args.model, "params": real["params"],
                    "batch": args.batch, "seq": args.seq, "vocab": args.vocab, "steps": args.steps,
                    "rounds": args.rounds, "wall_s": wall, "target": TARGET},
           "rows": rows_of(real)}
    _print(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def rows_of(real: dict[str, Any]) -> list[dict[str, Any]]:
    med = {k: statistics.median(v) for k, v in real["times"].items()}
    per_step = {k: statistics.median(v) for k, v in real["bytes"].items()}
    base, fp32 = med["fsdp2"], per_step["none"]
    rows = []
    for name in real["times"]:
        row: dict[str, Any] = {"config": name, "step_s": med[name], "ratio": med[name] / base,
                               "steps": len(real["times"][name])}
        if name != "fsdp2":
            row.update(bytes_per_step=per_step[name], bytes_ratio=per_step[name] / fp32 if fp32 else None)
        rows.append(row)
    return rows


def _print(out: dict[str, Any]) -> None:
    m, w = out["meta"], sys.stdout.write
    w(f"gradzip bench fsdp: {m['workers']} Gloo processes, bert-{m['model'].removeprefix('bert-')} "
      f"({m['params'] / 1e6:.2f} M parameters, vocab {m['vocab']}), batch {m['batch']} x {m['seq']} per worker, "
      f"{m['steps']} steps each\n")
    w(f"{'configuration':<26} {'step ms':>9} {'vs FSDP2':>9} {'bytes/step':>12} {'vs fp32':>8}\n")
    for r in out["rows"]:
        b = f"{'-':>12} {'-':>8}"  # plain FSDP2 sends nothing through gradzip
        if "bytes_per_step" in r:
            b = f"{r['bytes_per_step']:>12,.0f} {r['bytes_ratio']:>7.4f}x"
        w(f"{r['config']:<26} {r['step_s'] * 1e3:>9.1f} {r['ratio']:>8.3f}x {b}\n")
    none = next(r for r in out["rows"] if r["config"] == "none")
    ok = "meets" if none["ratio"] <= m["target"] else "misses"
    w(f"overhead: none / fsdp2 = {none['ratio']:.3f}x ({ok} target <= {m['target']}x)\n")
