"""``gradzip bench sync``: the local work of one DiLoCo sync and the memory it costs, against a memcpy.

For each ``--compressor``, one rank (a one-process Gloo group, so the exchange has nobody to talk
to and the network is excluded; the rank path of :class:`DiLoCo`, no simulated replicas) syncs
after every inner step (H = 1) of a BERT model (``--model``, no forward/backward: the parameters
are perturbed in place instead). Timed, interleaved
round by round with a memcpy of the same number of parameter bytes:

- ``sync_s``: :meth:`DiLoCo.after_inner_step` at a sync: pseudo-gradient Δ = θ_global − θ_local,
  compress + decode, the outer Nesterov step on θ_global, copy back into the model;
- ``memcpy_s``: one copy of every parameter (a flat tensor of the same size);
- ``ratio`` = sync_s / memcpy_s. Target (issue 18): <= 3 for the local work of one sync.
- ``outer``: ``fused`` times DiLoCo's fused outer step (:mod:`gradzip.engine.outer_step`: one C pass
  per tensor where the kernels are in use, else cache-blocked ``_foreach`` calls),
  ``step`` the same sync through ``outer.step()`` and a separate merge (``--outer both``: side by side).

With ``--codec SPEC ...``, also each codec alone on the model's pseudo-gradient (one tensor per
parameter, in its own shape, as DiLoCo hands them over; values N(0, 1e-3²), a pseudo-gradient's
scale: top-k and the quantiser do not depend on more), timed interleaved with one ``torch.clone``
of the same number of fp32 elements (allocation included, as a decode allocates its output):

- ``encode_s``: ``compress_batch`` of every parameter's tensor; ``decode_s``: ``decompress_batch``
  of that payload back to dense tensors; ``memcpy_s``: the clone;
- ``encode_ratio``, ``decode_ratio`` = each / memcpy_s. Target (issue 47, SparseLoCo's codec):
  <= 10 each.

Memory: ``extra_bytes`` is what DiLoCo holds beyond the model and the inner optimizer, per rank:
θ_global, the outer optimizer's state (Nesterov momentum: one more copy) and the compressor's
state (error memory with ``ef=true``), reported also as multiples of the parameter bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from gradzip.comm import init_communicator
from gradzip.comm.launch import free_port
from gradzip.compress.registry import create
from gradzip.engine.diloco import DiLoCo
from gradzip.models import bert_config, parameter_shapes
from gradzip.models.bert import BertForPreTraining

TARGET = 3.0
CODEC_TARGET = 10.0  # a codec's encode, and its decode, of the pseudo-gradient vs one memcpy of it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bert-mini", help="BERT size (default: bert-mini)")
    parser.add_argument("--compressor", nargs="+", default=["none", "int8bins", "intk:bits=4",
                                                            "topk:ratio=0.01,ef=true"],
                        help="pseudo-gradient compressors (default: none int8bins intk:bits=4 topk+EF)")
    parser.add_argument("--momentum", type=float, default=0.9, help="outer Nesterov momentum (default: 0.9)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: 5)")
    parser.add_argument("--outer", choices=("fused", "step", "both"), default="fused",
                        help="the outer step: fused (DiLoCo's one-pass one, the default when the outer "
                             "optimizer is a plain torch SGD), step (outer.step() then the merge), both")
    parser.add_argument("--codec", nargs="+", default=[], metavar="SPEC",
                        help="also time these codecs' encode and decode of the model's pseudo-gradient, each "
                             f"against one memcpy (torch clone) of it, e.g. --codec sparseloco (target <= "
                             f"{CODEC_TARGET:g}x)")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class _StepSGD(torch.optim.SGD):
    """A plain SGD that DiLoCo does not fuse (a subclass): it calls step(), then merges."""


def measure(model_name: str, spec: str, momentum: float, rounds: int, comm: Any,
            outer_path: str = "fused") -> dict[str, Any]:
    cfg = bert_config(model_name, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertForPreTraining(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    inner = torch.optim.SGD(params, lr=0.0)
    cls = torch.optim.SGD if outer_path == "fused" else _StepSGD
    outer = cls(params, lr=0.7, momentum=momentum, nesterov=momentum > 0, foreach=True)
    sync = DiLoCo(model, inner, outer, comm, 1, spec, hook=False)
    numel = sum(p.numel() for p in params)
    src, dst = torch.randn(numel), torch.empty(numel)
    noise = [torch.randn_like(p) * 1e-3 for p in params]
    sync_s, copy_s = [], []
    for r in range(rounds + 1):  # round 0 warms up (allocations, outer state)
        with torch.no_grad():
            for p, n in zip(params, noise):
                p.add_(n)  # as if the inner steps had moved the parameters
        t0 = time.perf_counter()
        sync.after_inner_step()
        t1 = time.perf_counter()
        dst.copy_(src)
        t2 = time.perf_counter()
        if r:
            sync_s.append(t1 - t0)
            copy_s.append(t2 - t1)
    extra = _tensor_bytes(sync.global_) + _tensor_bytes(outer.state_dict()["state"]) + \
        _tensor_bytes(sync.compressors[0].state_dict())
    s, c = statistics.median(sync_s), statistics.median(copy_s)
    return {"model": model_name, "compressor": spec, "outer": outer_path, "params": numel, "sync_s": s,
            "memcpy_s": c,
            "ratio": s / c, "target": TARGET, "extra_bytes": extra, "extra_x_params": extra / (4 * numel)}


def measure_codec(model_name: str, spec: str, rounds: int) -> dict[str, Any]:
    """One ``--codec`` row (module docstring): medians over ``rounds`` after one warm-up round."""
    comp = create(spec)
    gen = torch.Generator().manual_seed(0)
    delta = [torch.randn(s, generator=gen) * 1e-3 for s in parameter_shapes(bert_config(model_name)).values()]
    flat = torch.cat([d.reshape(-1) for d in delta])
    enc, dec, copy = [], [], []
    for r in range(rounds + 1):  # round 0 warms up
        t0 = time.perf_counter()
        payload, ctx = comp.compress_batch(delta, "bench")
        t1 = time.perf_counter()
        comp.decompress_batch(payload, ctx)
        t2 = time.perf_counter()
        flat.clone()
        t3 = time.perf_counter()
        if r:
            enc.append(t1 - t0)
            dec.append(t2 - t1)
            copy.append(t3 - t2)
    e, d, c = statistics.median(enc), statistics.median(dec), statistics.median(copy)
    return {"model": model_name, "codec": comp.spec, "params": flat.numel(),
            "payload_bytes": sum(p.numel() * p.element_size() for p in payload), "encode_s": e, "decode_s": d,
            "memcpy_s": c, "encode_ratio": e / c, "decode_ratio": d / c, "target": CODEC_TARGET}


def run(args: argparse.Namespace) -> int:
    # A one-process Gloo group; the variables are put back after, so that a caller's later
    # launches (mpirun, torchrun) do not inherit a world of one.
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        comm = init_communicator("gloo")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        paths = ("fused", "step") if args.outer == "both" else (args.outer,)
        rows = [measure(args.model, spec, args.momentum, args.rounds, comm, path)
                for spec in args.compressor for path in paths]
    finally:
        comm.close()
    codecs = [measure_codec(args.model, spec, args.rounds) for spec in args.codec]
    if args.json:
        print(json.dumps(rows + codecs, indent=2))
        return 0
    print(f"{rows[0]['model']}: {rows[0]['params']:,} parameters; one sync's local work vs one memcpy of them "
          f"(median of {args.rounds}); target <= {TARGET:g}x")
    print(f"{'compressor':<26}{'outer':>6}{'sync ms':>9}{'memcpy ms':>11}{'ratio':>8}{'extra MB':>10}{'x params':>10}")
    for r in rows:
        print(f"{r['compressor']:<26}{r['outer']:>6}{r['sync_s'] * 1e3:>9.2f}{r['memcpy_s'] * 1e3:>11.2f}"
              f"{r['ratio']:>7.2f}x{r['extra_bytes'] / 1e6:>10.1f}{r['extra_x_params']:>10.2f}")
    if codecs:
        print(f"\nEach codec's encode and decode of the pseudo-gradient vs one memcpy (torch clone) of it "
              f"(median of {args.rounds}); target <= {CODEC_TARGET:g}x")
        w = max(len(r["codec"]) for r in codecs) + 1
        print(f"{'codec':<{w}}{'payload MB':>11}{'encode ms':>11}{'decode ms':>11}{'memcpy ms':>11}"
              f"{'encode':>8}{'decode':>8}")
        for r in codecs:
            print(f"{r['codec']:<{w}}{r['payload_bytes'] / 1e6:>11.2f}{r['encode_s'] * 1e3:>11.1f}"
                  f"{r['decode_s'] * 1e3:>11.1f}{r['memcpy_s'] * 1e3:>11.2f}{r['encode_ratio']:>7.2f}x"
                  f"{r['decode_ratio']:>7.2f}x")
    return 0
