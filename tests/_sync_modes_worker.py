"""One rank of tests/test_sync_modes.py's sharded case: a sync mode chosen by ``--sharding``, built
through the registry alone (:func:`gradzip.engine.modes.build_synchronizer`) and driven by the
protocol's loop on Gloo. Writes DIR/rank<r>.json (or DIR/rank<r>.err with a traceback).

    python -m _sync_modes_worker --out DIR --sharding fsdp|hsdp
"""

from __future__ import annotations

import argparse
import datetime
import json
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

from gradzip.engine.modes import SyncSettings, build_synchronizer, load_modes  # noqa: E402
from gradzip.engine.synchronizer import Synchronizer  # noqa: E402
from gradzip.plan.sync import parse_sync  # noqa: E402


class Stepper:
    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt, self.steps = opt, 0

    def step(self, clip: bool = True) -> float:
        self.steps += 1
        self.opt.step()
        return 0.0

    def skip(self) -> None:
        pass


def run(sharding: str, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Linear(8, 4))
    replicas = None
    outer, _, sharding = sharding.rpartition("+")  # MODE+SHARDING: an outer --sync mode on the sharded model
    if sharding == "hsdp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        shard_mesh, replicas = mesh["shard"], mesh["replicate"].get_group()
    else:
        shard_mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    load_modes()  # the outer modes register their --sync spellings
    sync_spec = parse_sync(f"{outer}:every=2") if outer else parse_sync("step")
    settings = SyncSettings(spec="none", sync=sync_spec, sharding=sharding, replicas=replicas, timeout=60.0)
    sync = build_synchronizer(model, opt, type("Target", (), {"rank": rank})(), settings)
    stepper, sent = Stepper(opt), []
    for step in range(2):
        for w in sync.worker_ids:
            with sync.worker(w):
                g = torch.Generator().manual_seed(100 * step + rank)
                x, y = torch.randn(3, 6, generator=g), torch.randn(3, 4, generator=g)
                ((model(x) - y) ** 2).mean().backward()
                sync.after_backward(stepper)
        stats = sync.synchronize()
        sync.commit(stats.nonfinite, stepper)
        sent.append(float(stats.bytes_sent))
    n_params = sum(p.numel() for p in model.parameters())
    out = {"protocol": isinstance(sync, Synchronizer), "worker_ids": sync.worker_ids, "steps": stepper.steps,
           "eval_on_every_rank": sync.eval_on_every_rank, "summary": sync.summary(), "sent": sent,
           "fp32_bytes": sync.fp32_bytes(n_params), "n_params": n_params, "exchange": sync.exchange}
    sync.detach()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sharding", default="fsdp")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    try:
        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=datetime.timedelta(seconds=60))
        res = run(args.sharding, rank, dist.get_world_size())
        (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(res))
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException:
        (Path(args.out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    sys.exit(main())
