"""One rank of the FSDP tests (tests/test_fsdp.py): ``gradzip.fsdp_compress`` under FSDP2 on Gloo.

    python -m _fsdp_worker --out DIR --phases fsdp|hsdp

``fsdp`` (2 ranks): 1-D FSDP against plain FSDP2, compressors, accumulation, checkpoints, remove,
bad input. ``hsdp`` (4 ranks, a 2x2 mesh): gradzip's replica all-reduce against native HSDP.
Each rank writes DIR/rank<r>.pt with its results (or DIR/rank<r>.err with a traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

torch.set_num_threads(1)


def make_model(mesh: Any, integer: bool, reshard: bool = True) -> nn.Module:
    """Two linear layers (no bias on the first), each an FSDP module, and the root. ``integer``:
    integer weights, so that gradients of :func:`loss_of` on integer data are integers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Linear(8, 4))
    if integer:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randint(-3, 4, p.shape).float())
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def batch(step: int, worker: int, integer: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + worker)
    if integer:
        return torch.randint(-2, 3, (3, 6), generator=g).float(), torch.randint(-2, 3, (3, 4), generator=g).float()
    return torch.randn(3, 6, generator=g), torch.randn(3, 4, generator=g)


def loss_of(model: nn.Module, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = xy
    return (model(x) * y).sum()


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.to_local().clone() for p in model.parameters()]


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def train(model: nn.Module, rank: int, steps: int, integer: bool, accumulate: int = 1) -> list[list[torch.Tensor]]:
    """SGD steps; returns each step's sharded gradients (the last micro-batch syncs)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5 if integer else 0.05)
    out = []
    for s in range(steps):
        opt.zero_grad()
        for m in range(accumulate):
            model.set_requires_gradient_sync(m == accumulate - 1)
            loss_of(model, batch(s * accumulate + m, rank, integer)).backward()
        out.append(grads(model))
        opt.step()
    return out


def phase_fsdp(rank: int, n: int) -> dict:
    import gradzip
    from gradzip.errors import GradzipError

    mesh = init_device_mesh("cpu", (n,))
    res: dict = {}
    for integer in (True, False):  # none == plain FSDP2, bit for bit
        plain = train(make_model(mesh, integer), rank, 3, integer)
        model = make_model(mesh, integer)
        comp = gradzip.fsdp_compress(model, "none")
        res[f"none_{integer}"] = {"plain": plain, "gz": train(model, rank, 3, integer),
                                  "bytes": comp.bytes_sent, "stats": comp.stats}
        comp.remove()
    for spec in ("fp16", "bf16", "onebit", "topk:ratio=0.25,ef=true", "randomk:ratio=0.5",
                 "powersgd:rank=4,min_compression_rate=0", "threshold:ef=true"):
        model = make_model(mesh, False)
        comp = gradzip.fsdp_compress(model, spec)
        g = train(model, rank, 3, False)
        sd = comp.state_dict()
        res[spec] = {"grads": g, "bytes": comp.bytes_sent, "stats": comp.stats, "state": sd,
                     "rs_numel": [sum(-(-p.numel() // n) * n for p in m.parameters(recurse=False))
                                  for m in model],
                     "payload": [comp.compressor.payload_bytes(sum(-(-p.numel() // n) for p in m.parameters(
                         recurse=False)), torch.float32) for m in model]}
        comp.remove()
    res["plain"] = train(make_model(mesh, False), rank, 3, False)
    # FSDP's gradient divide factor (PREMUL_SUM): the sum over ranks divided by it.
    model = make_model(mesh, True)
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(8.0)
    comp = gradzip.fsdp_compress(model, "none")
    res["divide"] = train(model, rank, 1, True)
    res["divide_plain"] = train(make_model(mesh, True), rank, 1, True)
    comp.remove()
    # Gradient accumulation: one exchange per optimizer step.
    model = make_model(mesh, False)
    comp = gradzip.fsdp_compress(model, "onebit")
    train(model, rank, 2, False, accumulate=3)
    res["accum_calls"] = comp.stats["alltoall"]["calls"]
    comp.remove()
    res["resume"] = resume(mesh, rank, n)
    res["ef_dtype"] = ef_dtype(mesh, rank)
    # remove(): FSDP's own reduce-scatter again, and no more gradzip traffic.
    model = make_model(mesh, True)
    comp = gradzip.fsdp_compress(model, "onebit")
    comp.remove()
    res["removed"] = {"grads": train(model, rank, 1, True), "bytes": comp.bytes_sent,
                      "plain": train(make_model(mesh, True), rank, 1, True)}
    bad: dict = {}
    for what, kw in {"replicate": {"replicate": "node0"}, "spec": {"spec": "nosuch"},
                     "mismatch": {"spec": "onebit" if rank == 0 else "topk:ratio=0.1"}}.items():
        try:
            gradzip.fsdp_compress(make_model(mesh, False), kw.pop("spec", "none"), **kw)
            bad[what] = "no error"
        except GradzipError as e:
            bad[what] = str(e)
    model = make_model(mesh, False)
    first = gradzip.fsdp_compress(model, "none")
    try:
        gradzip.fsdp_compress(model, "onebit")
        bad["twice"] = "no error"
    except GradzipError as e:
        bad["twice"] = str(e)
    first.remove()
    res["bad"] = bad
    return res


def resume(mesh: Any, rank: int, n: int) -> dict:
    """Save after two steps, take a third; restore model, optimizer and gradzip; take it again."""
    import gradzip
    from gradzip.errors import GradzipError

    model = make_model(mesh, False)
    comp = gradzip.fsdp_compress(model, "topk:ratio=0.25,ef=true")
    train(model, rank, 2, False)
    saved, sd = params(model), comp.state_dict()
    first = train(model, rank, 1, False)
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.to_local().copy_(s)
    comp.load_state_dict(sd)
    again = train(model, rank, 1, False)
    out: dict = {"first": first, "again": again}
    other = dict(sd, mesh=[n * 2, 1])
    try:
        comp.load_state_dict(other)
        out["mismatch"] = "no error"
    except GradzipError as e:
        out["mismatch"] = str(e)
    comp.load_state_dict(other, reset_error=True)
    out["reset_memory"] = len(comp.state_dict()["compressor"]["memory"])
    comp.remove()
    return out


def ef_dtype(mesh: Any, rank: int) -> dict:
    import gradzip

    out = {}
    for dt in (None, torch.bfloat16):
        model = make_model(mesh, False)
        comp = gradzip.fsdp_compress(model, "topk:ratio=0.25,ef=true", ef_dtype=dt)
        g = train(model, rank, 3, False)
        mem = comp.state_dict()["compressor"]["memory"]
        flat = [t for v in mem.values() for t in (v if isinstance(v, list) else [v])]
        out[str(dt)] = {"grads": g, "mem_bytes": sum(t.numel() * t.element_size() for t in flat)}
        comp.remove()
    return out


def phase_hsdp(rank: int, n: int) -> dict:
    import gradzip
    from gradzip.errors import GradzipError

    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("replicate", "shard"))
    res: dict = {}
    for integer in (True, False):
        native = train(make_model(mesh, integer), rank, 3, integer)
        model = make_model(mesh["shard"], integer)
        comp = gradzip.fsdp_compress(model, "none", replicate=mesh["replicate"])
        res[f"none_{integer}"] = {"native": native, "gz": train(model, rank, 3, integer), "bytes": comp.bytes_sent}
        comp.remove()
    try:  # sharded over all four ranks and replicated as well: refused
        gradzip.fsdp_compress(make_model(init_device_mesh("cpu", (n,)), False), "none", replicate=mesh["replicate"])
        res["overlap"] = "no error"
    except GradzipError as e:
        res["overlap"] = str(e)
    model = make_model(mesh["shard"], False)
    comp = gradzip.fsdp_compress(model, "topk:ratio=0.25,ef=true", replicate=mesh["replicate"].get_group())
    res["topk"] = {"grads": train(model, rank, 3, False), "state": comp.state_dict(), "stats": comp.stats,
                   "shards": [sum(p.to_local().numel() for p in m.parameters(recurse=False)) for m in model]}
    comp.remove()
    for spec, dt in (("fp16", None), ("onebit:exchange=twophase", None), ("topk:ratio=0.25,ef=true", torch.bfloat16),
                     ("powersgd:rank=4,min_compression_rate=0", None)):
        model = make_model(mesh["shard"], False)
        comp = gradzip.fsdp_compress(model, spec, replicate=mesh["replicate"], ef_dtype=dt)
        res[f"{spec}/{dt}"] = {"grads": train(model, rank, 3, False), "stats": comp.stats}
        comp.remove()
    return res


def lost_rank(out: Path, rank: int) -> None:
    """Rank 1 leaves after the forward (parameters stay gathered: no all-gather in backward); rank
    0's reduce-scatter, gradzip's, must fail within its timeout, naming rank 1."""
    import gradzip

    model = make_model(init_device_mesh("cpu", (dist.get_world_size(),)), False, reshard=False)
    gradzip.fsdp_compress(model, "onebit", timeout=3.0)
    loss = loss_of(model, batch(0, rank, False))
    if rank == 1:
        os._exit(0)  # no teardown: the peer's collective is left without it
    t0 = time.monotonic()
    try:
        loss.backward()
        msg = "no error"
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
    torch.save({"msg": msg, "s": time.monotonic() - t0}, out / f"rank{rank}.lost.pt")
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="fsdp")
    args = ap.parse_args()
    out = Path(args.out)
    rank = int(os.environ["RANK"])
    try:
        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=__import__("datetime").timedelta(seconds=60))
        n = dist.get_world_size()
        res = phase_fsdp(rank, n) if args.phases == "fsdp" else phase_hsdp(rank, n)
        torch.save(res, out / f"rank{rank}.pt")
        dist.barrier()
        if args.phases == "fsdp":  # last: a rank that never reaches the reduce-scatter
            lost_rank(out, rank)
        dist.destroy_process_group()
        return 0
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    sys.exit(main())
