"""``gradzip bench engine``: the engine against torch DDP, side by side, and how much of the
communication it hides.

``--workers`` Gloo processes on this host (started by :func:`gradzip.comm.spawn_local`) each build
the same model (BERT from :mod:`gradzip.models`, ``--model mini`` = bert-mini: 4 layers, hidden 256)
on a synthetic masked-LM batch, then time, interleaved round by round so that load changes hit
every configuration alike (each step starts after a barrier; median of the steps; forward +
backward + exchange, no optimizer):

1. ``compute``: forward + backward alone (no communication);
2. engine overhead: ``ddp`` (DistributedDataParallel, Gloo allreduce) vs ``gradzip`` (the engine
   with ``none``), same bucket cap. Target <= 1.05x.
3. PowerSGD rank 4: ``ddp-powersgd`` (DDP + torch's ``powerSGD_hook``, error feedback, warm start,
   same-shape batching, compressing from step 2) vs ``gradzip-powersgd`` (``--powersgd``, default
   ``powersgd:rank=4``; ``residual=reduced`` is the hook's own form of error feedback). Target <= 0.9x.
4. overlap on a slow link: the engine with ``none`` over an *emulated* link: every collective
   occupies a serial link for its α–β time (:mod:`gradzip.comm.cost`) and its ``wait()`` returns no
   earlier than that (the real Gloo transfer happens underneath). The bandwidth is set so that the
   step's communication takes ``--comm-ratio`` x the measured compute. Reported: step time /
   max(compute, communication). Target <= 1.15x. The same is computed with the ``sim`` backend's
   virtual clock in this process (modelled step_s / max(compute + compress, link time)).

What bounds the overlap: nothing can be sent before the first bucket is complete, which is after
the whole forward pass (about a third of compute) and the head's backward; and the last bucket
(BERT's word embeddings, tied with the MLM decoder, complete only at the very end of backward)
overlaps nothing. The ``sim`` rows report that bound as ``ideal_ratio`` =
max(compute, first bucket ready + communication) / max(compute, communication). ``--comm-ratio``
values well above 1 (a slow link) are where the target can be met.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from gradzip.comm import SimWorld, cost, init_communicator, spawn_local
from gradzip.comm.base import Communicator, Handle, ReduceOp, nbytes
from gradzip.compress import create
from gradzip.engine import attach
from gradzip.errors import GradzipError, SpecError
from gradzip.models import bert_config
from gradzip.models.bert import BertForPreTraining

TARGETS = {"overhead": 1.05, "powersgd": 0.9, "overlap": 1.15}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4, help="Gloo processes (default: 4)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration per round (default: 3)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default: 4)")
    parser.add_argument("--model", default="mini", help="BERT size: tiny, mini, small, ... (default: mini)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per worker (default: 8)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (default: 128)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="bucket cap, DDP and engine (default: 25)")
    parser.add_argument("--overlap-cap-mb", type=float, default=2.0,
                        help="bucket cap for the overlap measurement (default: 2)")
    parser.add_argument("--comm-ratio", type=float, nargs="+", default=[1.0, 2.0, 4.0],
                        help="emulated communication time / compute time (default: 1 2 4)")
    parser.add_argument("--powersgd", default="powersgd:rank=4", metavar="SPEC",
                        help="the gradzip side of the PowerSGD comparison (default: powersgd:rank=4; "
                             "powersgd:rank=4,residual=reduced is the hook's own error feedback)")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    parser.add_argument("--_worker", help=argparse.SUPPRESS)


# ------------------------------------------------------------------ model and batch
def build_model(name: str, seq: int) -> torch.nn.Module:
    full = name if name.startswith("bert-") else f"bert-{name}"
    cfg = bert_config(full, max_position_embeddings=max(seq, 128), hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return BertForPreTraining(cfg)


def make_batch(model: torch.nn.Module, batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size  # type: ignore[union-attr]
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    labels = torch.full_like(ids, -100)
    mask = torch.rand(batch, seq, generator=g) < 0.15
    labels[mask] = ids[mask]
    return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
            "labels": labels, "next_sentence_label": torch.randint(0, 2, (batch,), generator=g)}


# ------------------------------------------------------------------ emulated slow link
class _DelayedHandle(Handle):
    def __init__(self, inner: Handle, done_at: float) -> None:
        self.inner, self.done_at = inner, done_at

    def wait(self) -> Any:
        out = self.inner.wait()
        left = self.done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return out


class SlowLink(Communicator):
    """Wraps a communicator: collectives occupy one serial link for their α–β time."""

    def __init__(self, inner: Communicator, link: cost.Link) -> None:
        super().__init__(inner.rank, inner.world_size, inner.timeout)
        self.inner, self.link, self.free_at = inner, link, 0.0
        self.stats = inner.stats
        self.clock = inner.clock  # type: ignore[misc]

    def _occupy(self, seconds: float) -> float:
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + seconds
        return self.free_at

    def allreduce_async(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> Handle:
        t = cost.allreduce_time(nbytes(tensor), self.world_size, self.link)
        return _DelayedHandle(self.inner.allreduce_async(tensor, op), self._occupy(t))

    def allgather_async(self, tensor: torch.Tensor, same_shape: bool = False) -> Handle:
        t = cost.allgather_time([nbytes(tensor)] * self.world_size, self.link)
        return _DelayedHandle(self.inner.allgather_async(tensor, same_shape), self._occupy(t))

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> Handle:
        t = cost.broadcast_time(nbytes(tensor), self.world_size, self.link)
        return _DelayedHandle(self.inner.broadcast_async(tensor, src), self._occupy(t))

    def alltoall_async(self, tensor: torch.Tensor) -> Handle:
        t = cost.alltoall_time(nbytes(tensor), self.world_size, self.link)
        return _DelayedHandle(self.inner.alltoall_async(tensor), self._occupy(t))

    def split(self, colour: int, key: int | None = None) -> Communicator:
        return SlowLink(self.inner.split(colour, key), self.link)

    def barrier(self) -> None:
        self.inner.barrier()


def allreduce_seconds_per_step(engine: Any, n: int, link: cost.Link) -> float:
    return sum(cost.allreduce_time(b.nbytes, n, link) for b in engine.buckets)


# ------------------------------------------------------------------ one rank
def _clone(proto: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    m = build_model(args.model, args.seq)
    m.load_state_dict(proto.state_dict())
    return m


def _fwd_bwd(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()


def _timed(comm: Communicator, step: Callable[[], None], k: int) -> list[float]:
    """``k`` runs of ``step``, each after a barrier: their seconds."""
    out = []
    for _ in range(k):
        comm.barrier()
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def _configurations(args: argparse.Namespace, comm: Communicator, proto: torch.nn.Module,
                    batch: dict[str, torch.Tensor]) -> tuple[dict[str, Callable[[], None]], Any, Any]:
    """One step per configuration compared (compute, ddp, gradzip, ddp-powersgd, gradzip-powersgd),
    each on its own copy of ``proto``: (the steps, the engine with ``none``, the PowerSGD hook's
    state, which must outlive the steps)."""
    models: dict[str, torch.nn.Module] = {}
    steps: dict[str, Callable[[], None]] = {}
    models["compute"] = _clone(proto, args)
    steps["compute"] = lambda: _fwd_bwd(models["compute"], batch)
    models["ddp"] = DDP(_clone(proto, args), bucket_cap_mb=args.bucket_cap_mb)
    steps["ddp"] = lambda: _fwd_bwd(models["ddp"], batch)
    models["gradzip"] = _clone(proto, args)
    eng_none = attach(models["gradzip"], "none", comm, bucket_cap_mb=args.bucket_cap_mb)
    steps["gradzip"] = lambda: (_fwd_bwd(models["gradzip"], batch), eng_none.finalize())  # type: ignore[func-returns-value]
    models["ddp-powersgd"] = DDP(_clone(proto, args), bucket_cap_mb=args.bucket_cap_mb)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                               min_compression_rate=2, use_error_feedback=True, warm_start=True,
                               batch_tensors_with_same_shape=True)
    models["ddp-powersgd"].register_comm_hook(state, psgd.powerSGD_hook)
    steps["ddp-powersgd"] = lambda: _fwd_bwd(models["ddp-powersgd"], batch)
    models["gradzip-powersgd"] = _clone(proto, args)
    eng_psgd = attach(models["gradzip-powersgd"], args.powersgd, comm, bucket_cap_mb=args.bucket_cap_mb)
    steps["gradzip-powersgd"] = lambda: (_fwd_bwd(models["gradzip-powersgd"], batch),  # type: ignore[func-returns-value]
                                         eng_psgd.finalize())
    return steps, eng_none, state


def _overlap_runs(args: argparse.Namespace, comm: Communicator, proto: torch.nn.Module,
                  batch: dict[str, torch.Tensor], compute: float) -> tuple[list[dict[str, Any]], Any]:
    """Overlap on an emulated link: bandwidth from rank 0's compute median, the same on every rank.
    Returns the rows (one per ``--comm-ratio``) and the last engine."""
    n = comm.world_size
    overlap = []
    model = _clone(proto, args)
    probe = attach(_clone(proto, args), "none", comm, bucket_cap_mb=args.overlap_cap_mb, broadcast=False)
    unit = allreduce_seconds_per_step(probe, n, cost.Link(8.0))  # seconds at 1 byte/s, no latency
    probe.detach()
    for ratio in args.comm_ratio:
        bw = torch.tensor([8.0 * unit / (ratio * compute)], dtype=torch.float64)
        comm.broadcast(bw, 0)
        link = cost.Link(float(bw.item()), 0.0)
        eng = attach(model, "none", SlowLink(comm, link), bucket_cap_mb=args.overlap_cap_mb, broadcast=False)

        def step(e: Any = eng) -> None:
            _fwd_bwd(model, batch)
            e.finalize()

        _timed(comm, step, 2)
        st = _timed(comm, step, args.steps * args.rounds)
        comm_s = allreduce_seconds_per_step(eng, n, link)
        eng.detach()
        overlap.append({"comm_ratio": ratio, "bandwidth_bps": link.bandwidth_bps, "comm_s": comm_s,
                        "step_s": statistics.median(st), "steps": st})
    return overlap, eng


def _rank_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    comm = init_communicator("gloo", timeout=900.0)
    rank, n = comm.rank, comm.world_size
    proto = build_model(args.model, args.seq)
    batch = make_batch(proto, args.batch, args.seq, seed=rank)
    steps, eng_none, state = _configurations(args, comm, proto, batch)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for name in steps:  # warm-up: allocations, DDP's bucket rebuild, PowerSGD's start iteration
        _timed(comm, steps[name], 3)
    for _ in range(args.rounds):
        for name in steps:
            times[name] += _timed(comm, steps[name], args.steps)
    compute = statistics.median(times["compute"])
    overlap, eng = _overlap_runs(args, comm, proto, batch, compute)
    if rank == 0:
        out = {"workers": n, "params": sum(p.numel() for p in proto.parameters()), "compute": compute,
               "times": times, "overlap": overlap, "buckets": len(eng_none.buckets),
               "overlap_buckets": len(eng.buckets)}
        Path(args._worker, "rank0.json").write_text(json.dumps(out))
    del state
    comm.barrier()
    comm.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------ sim overlap (this process)
def sim_overlap(args: argparse.Namespace, ratio: float) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = build_model(args.model, args.seq)
    batches = [make_batch(model, args.batch, args.seq, seed=w) for w in range(args.workers)]
    model(**batches[0]).loss.backward()  # warm-up
    t0 = time.perf_counter()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        model(**batches[0]).loss.backward()
    compute = (time.perf_counter() - t0) / 2
    world = SimWorld(args.workers, bandwidth=1e9, latency=0.0)
    engine = attach(model, "none", world, bucket_cap_mb=args.overlap_cap_mb)
    unit = allreduce_seconds_per_step(engine, args.workers, cost.Link(8.0))
    world.inter = cost.Link(8.0 * unit / (ratio * compute), 0.0)  # comm = ratio x compute (one worker a node)
    rows = []
    for _ in range(3):
        for w in engine.worker_ids:
            with engine.worker(w):
                model(**batches[w]).loss.backward()
        rows.append(engine.finalize())
    st = rows[-1]
    busy = st.compute_s + st.compress_s
    bound = max(busy, st.link_s)
    # No bucketed schedule can start sending before the first bucket is complete.
    first = engine.last_timings[0].ready_s + engine.last_timings[0].compress_s
    return {"comm_ratio": ratio, "compute_s": st.compute_s, "compress_s": st.compress_s, "link_s": st.link_s,
            "comm_s": st.comm_s, "step_s": st.step_s, "ratio": st.step_s / bound, "buckets": st.buckets,
            "first_bucket_ready_s": first, "ideal_ratio": max(busy, first + st.link_s) / bound}


# ------------------------------------------------------------------ entry point
def run(args: argparse.Namespace) -> int:
    if args._worker:
        return _rank_main(args)
    if args.workers < 2 or args.steps < 1 or args.rounds < 1:
        raise GradzipError(f"--workers must be >= 2 and --steps/--rounds >= 1 (got {args.workers}, {args.steps}, "
                           f"{args.rounds})")
    build_model(args.model, args.seq)  # a bad --model fails here, before any process starts
    try:
        if create(args.powersgd).name != "powersgd":
            raise SpecError(f"--powersgd takes a powersgd spec, got {args.powersgd!r}")
    except SpecError as e:
        raise GradzipError(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="gradzip-bench-engine-") as tmp:
        argv = ["bench", "engine", "--_worker", tmp, "--model", args.model, "--steps", str(args.steps),
                "--rounds", str(args.rounds), "--batch", str(args.batch), "--seq", str(args.seq),
                "--bucket-cap-mb", str(args.bucket_cap_mb), "--overlap-cap-mb", str(args.overlap_cap_mb),
                "--powersgd", args.powersgd, "--comm-ratio", *map(str, args.comm_ratio)]
        t0 = time.perf_counter()
        rc = spawn_local("gloo", args.workers, argv, timeout=3600)
        if rc != 0:
            raise GradzipError(f"benchmark workers failed (exit code {rc}); see their output above")
        real = json.loads(Path(tmp, "rank0.json").read_text())
        wall = time.perf_counter() - t0
    med = {k: statistics.median(v) for k, v in real["times"].items()}
    rows: list[dict[str, Any]] = [
        {"part": "overhead", "baseline": "ddp", "gradzip": "gradzip", "baseline_s": med["ddp"],
         "gradzip_s": med["gradzip"], "ratio": med["gradzip"] / med["ddp"], "target": TARGETS["overhead"]},
        {"part": "powersgd", "baseline": "ddp-powersgd", "gradzip": "gradzip-powersgd",
         "baseline_s": med["ddp-powersgd"], "gradzip_s": med["gradzip-powersgd"],
         "ratio": med["gradzip-powersgd"] / med["ddp-powersgd"], "target": TARGETS["powersgd"]},
    ]
    for o in real["overlap"]:
        bound = max(real["compute"], o["comm_s"])
        rows.append({"part": "overlap-emulated", "comm_ratio": o["comm_ratio"], "compute_s": real["compute"],
                     "comm_s": o["comm_s"], "step_s": o["step_s"], "ratio": o["step_s"] / bound,
                     "target": TARGETS["overlap"]})
    for ratio in args.comm_ratio:
        rows.append({"part": "overlap-sim", **sim_overlap(args, ratio), "target": TARGETS["overlap"]})
    meta = {"workers": real["workers"], "model": args.model, "params": real["params"], "batch": args.batch,
            "seq": args.seq, "bucket_cap_mb": args.bucket_cap_mb, "buckets": real["buckets"],
            "overlap_cap_mb": args.overlap_cap_mb, "overlap_buckets": real["overlap_buckets"],
            "medians_s": med, "steps_timed": {k: len(v) for k, v in real["times"].items()}, "wall_s": wall,
            "step_times_s": real["times"]}
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
    else:
        _print(meta, rows)
    return 0


def _print(meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    w = sys.stdout.write
    w(f"gradzip bench engine: {meta['workers']} Gloo processes, bert-{meta['model'].removeprefix('bert-')} "
      f"({meta['params'] / 1e6:.1f} M parameters), batch {meta['batch']} x {meta['seq']} per worker\n")
    w("median step time (forward + backward + exchange), per configuration:\n")
    for k, v in meta["medians_s"].items():
        w(f"  {k:<18} {v * 1e3:9.1f} ms  ({meta['steps_timed'][k]} steps)\n")
    for r in rows:
        ok = "meets" if r["ratio"] <= r["target"] else "misses"
        if r["part"] in ("overhead", "powersgd"):
            w(f"{r['part']:<17} {r['gradzip']} / {r['baseline']} = {r['ratio']:.3f}x ({ok} target "
              f"<= {r['target']}x)\n")
        else:
            ideal = f"; no bucketed schedule beats {r['ideal_ratio']:.3f}x" if "ideal_ratio" in r else ""
            w(f"{r['part']:<17} comm = {r['comm_ratio']:g} x compute: step {r['step_s'] * 1e3:.1f} ms / "
              f"max(compute, comm) = {r['ratio']:.3f}x ({ok} target <= {r['target']}x{ideal})\n")
