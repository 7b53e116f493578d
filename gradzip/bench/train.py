"""``gradzip bench train``: training throughput of BERT models on this machine, and the loss
bert-tiny reaches after a stated number of steps.

Throughput: for each model (``--models``, or ``--model``) and each precision (``--precision``:
fp32, bf16, fp16, comma-separated for several; fp16 needs CUDA), ``gradzip train`` with one worker
(backend ``sim``, compressor ``none``, ``--batch-size`` x ``--seq-len``, AdamW) on ``--device``
(auto, cpu or cuda, as for ``gradzip train``), ``--steps`` steps, no evaluation and no
checkpoints. Reported: non-padding tokens per second and milliseconds per step, measured on the
host clock over the steps after the first ``--skip`` (warm-up), optimizer included. With a single
``sim`` worker nothing is communicated, so this is plain single-process training speed.

Convergence: bert-tiny trained for ``--loss-steps`` steps (same settings, fp32 on ``--device``, LR warm-up 10% then
linear decay) on the default corpus (or ``--corpus``); reported: the held-out loss before training
and after the last step, and the last training loss.

Uses torch's default thread count (printed); set ``OMP_NUM_THREADS`` to change it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from gradzip.errors import GradzipError
from gradzip.training.config import TrainConfig
from gradzip.training.loop import train
from gradzip.training.metrics import read_metrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", "--model", dest="models", default="bert-tiny,bert-mini",
                        help="comma-separated (default: bert-tiny,bert-mini)")
    parser.add_argument("--precision", default="fp32",
                        help="fp32, bf16 or fp16 (CUDA only), comma-separated for one row each (default: fp32)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="as for gradzip train (default: auto, CUDA when there is one)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per model (default: 30)")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps not timed (default: 5)")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step (default: 32)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    parser.add_argument("--loss-steps", type=int, default=300,
                        help="steps of the bert-tiny convergence run (0: skip it; default: 300)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak LR of the convergence run (default: 1e-3)")
    parser.add_argument("--corpus", default=None, help="corpus (default: the built-in one)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _run(out: Path, **kw: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    cfg = TrainConfig.from_dict({"backend": "sim", "workers": 1, "compressor": "none", "checkpoint_every": 0,
                                 "progress": False, "out": str(out), **kw})
    summary = train(cfg)
    return summary, read_metrics(out / "metrics.jsonl")


def throughput(model: str, steps: int, skip: int, batch_size: int, seq_len: int, corpus: str | None,
               precision: str = "fp32", device: str = "auto") -> dict[str, Any]:
    """One model's training speed at one precision: tokens/s and ms/step over the steps after ``skip``."""
    with tempfile.TemporaryDirectory(prefix="gradzip-bench-") as tmp:
        summary, recs = _run(Path(tmp) / "run", model=model, steps=skip + steps, batch_size=batch_size,
                             seq_len=seq_len, eval_batches=0, corpus=corpus, precision=precision, device=device)
    first, last = recs[skip - 1] if skip else {"tokens": 0, "host_s": 0.0}, recs[-1]
    host = last["host_s"] - first["host_s"]
    step_times = [b["host_s"] - a["host_s"] for a, b in zip(recs[skip - 1:], recs[skip:])] if skip else []
    return {"model": model, "precision": precision, "device": _device_name(device), "params": summary["params"],
            "batch_size": batch_size, "seq_len": seq_len,
            "steps": steps, "tokens_per_s": (last["tokens"] - first["tokens"]) / host,
            "ms_per_step": 1000 * host / steps,
            "ms_per_step_median": 1000 * statistics.median(step_times) if step_times else None,
            "threads": torch.get_num_threads()}


def _device_name(device: str) -> str:
    """``cuda (NVIDIA H200)`` or ``cpu``: the device ``--device`` resolves to, for the rows."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "cuda"
    return "cpu"


def convergence(steps: int, batch_size: int, seq_len: int, lr: float, corpus: str | None,
                device: str = "auto") -> dict[str, Any]:
    """bert-tiny's held-out loss before and after ``steps`` fp32 steps."""
    with tempfile.TemporaryDirectory(prefix="gradzip-bench-") as tmp:
        summary, _ = _run(Path(tmp) / "run", model="bert-tiny", steps=steps, batch_size=batch_size, seq_len=seq_len,
                          lr=lr, warmup=0.1, eval_every=max(1, steps // 4), eval_batches=32, corpus=corpus,
                          device=device)
    return {"model": "bert-tiny", "steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr,
            "initial_eval_loss": summary["initial_eval_loss"], "final_eval_loss": summary["final_eval_loss"],
            "final_loss": summary["final_loss"], "host_s": summary["host_s"]}


def run(args: argparse.Namespace) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    if not models or not precisions or args.steps < 1 or args.skip < 0 or args.loss_steps < 0:
        raise GradzipError("need at least one --models and --precision entry, --steps >= 1, --skip >= 0 and "
                           "--loss-steps >= 0")
    if bad := [p for p in precisions if p not in ("fp32", "bf16", "fp16")]:
        raise GradzipError(f"--precision: unknown {', '.join(bad)}; choose from fp32, bf16, fp16")
    say = (lambda *a, **k: None) if args.json else (lambda *a, **k: print(*a, **k, flush=True))
    say(f"training throughput, 1 worker, AdamW, device {_device_name(args.device)}, "
        f"{torch.get_num_threads()} torch threads")
    say(f"{'model':<12} {'precision':<9} {'params':>11} {'batch x seq':>12} {'ms/step':>9} {'tokens/s':>10}")
    rows = []
    for m in models:  # each row as soon as it is measured
        for prec in precisions:
            r = throughput(m, args.steps, args.skip, args.batch_size, args.seq_len, args.corpus, prec, args.device)
            rows.append(r)
            say(f"{r['model']:<12} {prec:<9} {r['params']:>11,} {r['batch_size']:>5} x {r['seq_len']:<4} "
                f"{r['ms_per_step']:>9.1f} {r['tokens_per_s']:>10,.0f}")
    conv = None
    if args.loss_steps:
        conv = convergence(args.loss_steps, args.batch_size, args.seq_len, args.lr, args.corpus, args.device)
        say(f"\nbert-tiny after {conv['steps']} steps (batch {conv['batch_size']} x {conv['seq_len']}, "
            f"peak LR {conv['lr']:g}): eval loss {conv['initial_eval_loss']:.3f} -> {conv['final_eval_loss']:.3f}, "
            f"last train loss {conv['final_loss']:.3f} ({conv['host_s']:.0f} s)")
    if args.json:
        print(json.dumps({"throughput": rows, "convergence": conv}, indent=2))
    return 0
