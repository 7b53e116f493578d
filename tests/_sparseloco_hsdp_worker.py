"""One rank of tests/test_sparseloco_hsdp.py: ``--sync sparseloco`` over HSDP on a 2x2 Gloo mesh.

    python -m _sparseloco_hsdp_worker --out DIR

Each rank trains a two-layer model sharded over its node (ranks r // 2) with
:class:`gradzip.engine.sparseloco_hsdp.HSDPSparseLoCo` for 4 steps (2 syncs), recording its shards
before and after each sync, and writes DIR/rank<r>.pt (or DIR/rank<r>.err with a traceback).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

torch.set_num_threads(1)
SYNC = "sparseloco:every=2,chunk=2,k=3,beta=0.9,alpha=0.5"


def shards(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def run(rank: int, sync_text: str, steps: int) -> dict:
    from gradzip.engine.sparseloco_hsdp import HSDPSparseLoCo
    from gradzip.plan.sync import parse_sync

    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Tanh(), nn.Linear(8, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = HSDPSparseLoCo(model, opt, parse_sync(sync_text), mesh["replicate"].get_group(), rank, timeout=60.0)
    res: dict = {"start": shards(model), "before": [], "after": [], "bytes": []}

    class Stepper:
        def step(self, clip: bool = True) -> float:
            opt.step()
            res["before"].append(shards(model))  # after the inner step, before any sync
            return 0.0

        def skip(self) -> None:
            raise AssertionError("no step is skipped")

    for step in range(steps):
        with sync.worker(rank):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(3, 6, generator=g), torch.randn(3, 4, generator=g)
            ((model(x) - y) ** 2).mean().backward()
            sync.after_backward(Stepper())
        stats = sync.synchronize()
        sync.commit(0, Stepper())
        res["after"].append(shards(model))
        res["bytes"].append((stats.bytes_sent, stats.intra_bytes_sent, stats.syncs))
    res["memory"] = [(m.numel(), m.dtype) for mems in sync.compressor.memory.values() for m in mems]
    res["shard_numel"] = sum(t.numel() for t in shards(model))
    res["payload"] = sync.compressor.batch_payload_bytes([t.shape for t in shards(model)])
    sync.detach()
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = Path(ap.parse_args().out)
    rank = int(os.environ["RANK"])
    try:
        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=datetime.timedelta(seconds=60))
        res = {"fp32": run(rank, SYNC, 4), "bf16": run(rank, SYNC + ",ef_dtype=bf16", 2)}
        torch.save(res, out / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    sys.exit(main())
