"""One rank of the multi-process engine tests (tests/test_engine_dist.py), and the shared model,
data and training loop that the test also runs on the ``sim`` backend as the reference.

    python tests/_engine_dist_worker.py --backend gloo|mpi --out DIR
            --phases matrix,hier,mismatch,ddp,ddp_auto,demo,hang [--specs a;b;c]

``hier``: the hierarchical exchange with two ranks per emulated node (GRADZIP_NODE = rank // 2).
``demo``: the DeMo optimizer standalone (its own exchanges) and through the engine.

Each rank writes DIR/rank<r>.pt with its results (or DIR/rank<r>.err with a traceback); the
hang phase's surviving rank writes DIR/rank<r>.hang.pt.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

torch.set_num_threads(1)

ENGINE_KW = dict(bucket_cap_mb=0.002, min_compress_numel=32)  # several buckets, small ones plain
DDP_KW = dict(bucket_cap_mb=25.0, min_compress_numel=32)  # one DDP bucket <-> one compressed bucket
STEPS = 3
LR = 0.1


class Net(nn.Module):
    def __init__(self, empty: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 24)
        self.norm = nn.LayerNorm(24)
        self.fc2 = nn.Linear(24, 24)
        self.head = nn.Linear(24, 5)
        self.odd = nn.Parameter(torch.linspace(-1, 1, 7))
        self.empty = nn.Parameter(torch.empty(0)) if empty else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.fc1(x)))
        h = torch.relu(self.fc2(h))
        out = self.head(h) + 0.1 * self.odd.sum()
        return out + self.empty.sum() if self.empty is not None else out


def make_model(empty: bool = True) -> Net:
    torch.manual_seed(0)
    return Net(empty)


def batch(step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + worker)
    return torch.randn(6, 12, generator=g), torch.randn(6, 5, generator=g)


def loss_of(model: nn.Module, xy) -> torch.Tensor:
    return nn.functional.mse_loss(model(xy[0]), xy[1])


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


@torch.no_grad()
def sgd_step(model: nn.Module) -> None:
    """Plain SGD (torch.optim's first step imports torch._dynamo: seconds per process)."""
    for p in model.parameters():
        p.add_(p.grad, alpha=-LR)


def train_engine(spec: str, comm, kw: dict | None = None, model: nn.Module | None = None) -> dict:
    """STEPS optimizer steps through the engine; comm is a Communicator or a SimWorld."""
    from gradzip.engine import attach

    model = model if model is not None else make_model()
    engine = attach(model, spec, comm, **(kw or ENGINE_KW))
    grads, sent = [], []
    for step in range(STEPS):
        for w in engine.worker_ids:
            with engine.worker(w):
                loss_of(model, batch(step, w)).backward()
        sent.append(engine.finalize().bytes_sent)
        grads.append(flat_grads(model))
        sgd_step(model)
    engine.detach()
    return {"grads": grads, "params": flat_params(model), "bytes_sent": sent}


DEMO_SPEC = "demo:topk=4,chunk=8,decay=0.9"
DEMO_KW = dict(compression_topk=4, compression_chunk=8, compression_decay=0.9)
DEMO_LR, DEMO_WD = 0.01, 0.1


def train_demo(comm, standalone: bool) -> dict:
    """STEPS DeMo steps: standalone (``comm``: this rank's Communicator; the optimizer exchanges),
    or through the engine (``comm``: a Communicator or a SimWorld; the demo compressor, configure)."""
    from gradzip.engine import attach
    from gradzip.optim import DeMo

    model = make_model()
    if standalone:
        opt = DeMo(model.parameters(), lr=DEMO_LR, weight_decay=DEMO_WD, comm=comm, **DEMO_KW)
        for step in range(STEPS):
            model.zero_grad(set_to_none=True)
            loss_of(model, batch(step, comm.rank)).backward()
            opt.step()
        return {"params": flat_params(model)}
    engine = attach(model, DEMO_SPEC, comm, bucket_cap_mb=0.002, min_compress_numel=0)
    opt = DeMo(model.parameters(), lr=DEMO_LR, weight_decay=DEMO_WD)
    for step in range(STEPS):
        opt.configure(engine)
        for w in engine.worker_ids:
            with engine.worker(w):
                loss_of(model, batch(step, w)).backward()
        engine.finalize()
        opt.step()
    engine.detach()
    return {"params": flat_params(model)}


def train_ddp(spec: str, rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip

    model = make_model(empty=False)
    # Default DDP: it rebuilds its buckets after step 1, in the order gradients became ready, and
    # the hook carries each parameter's error memory over to its new bucket.
    ddp = DDP(model, bucket_cap_mb=DDP_KW["bucket_cap_mb"])
    state, hook = gradzip.ddp_hook(spec, min_compress_numel=DDP_KW["min_compress_numel"], timeout=60)
    ddp.register_comm_hook(state, hook)
    grads = []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        loss_of(ddp, batch(step, rank)).backward()
        grads.append(flat_grads(model))
        sgd_step(model)
    state.close()
    sd = state.state_dict()
    return {"grads": grads, "params": flat_params(model), "layouts": {i: len(v) for i, v in state._layouts.items()},
            "members": sorted(sd["members"]), "memory": sorted(sd["compressor"].get("memory", {}))}


AUTO_SPEC = "auto:candidates=topk:ratio=0.1+ef=true/powersgd:rank=2,replan_every=2"


def train_ddp_auto(rank: int, out: Path) -> dict:
    """``gradzip.ddp_hook("auto")`` on default DDP: uncompressed steps 1-2 (DDP rebuilds its bucket
    after step 1), a plan at the end of step 2, re-plans every 2 steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip

    model = make_model(empty=False)
    ddp = DDP(model, bucket_cap_mb=DDP_KW["bucket_cap_mb"])
    state, hook = gradzip.ddp_hook(AUTO_SPEC, min_compress_numel=DDP_KW["min_compress_numel"], timeout=60,
                                   log=out / "policy.jsonl")
    ddp.register_comm_hook(state, hook)
    bytes_per_step = []
    for step in range(6):
        model.zero_grad(set_to_none=True)
        loss_of(ddp, batch(step, rank)).backward()
        bytes_per_step.append(state.stats()["bytes_per_step"])
        sgd_step(model)
    state.close()
    return {"params": flat_params(model), "assigned": dict(state.assigned), "plans": list(state.plans),
            "summary": state.summary(), "layouts": {i: len(v) for i, v in state._layouts.items()},
            "bytes": bytes_per_step}


DDP_SPECS = ["none", "fp16", "topk:ratio=0.1,ef=true", "onebit", "signsgd", "powersgd:rank=2",
             "topk:ratio=0.1,ef=true,exchange=sparse", "onebit:exchange=twophase"]
# twophase cuts the flat bucket into chunks: its result depends on the order of the gradients in
# the bucket, which DDP lays out differently from the engine (the test compares ranks instead).
ORDER_DEPENDENT = {"onebit:exchange=twophase"}
HIER_SPECS = ["none", "fp16", "onebit:exchange=twophase", "topk:ratio=0.1,ef=true,exchange=sparse", "powersgd:rank=2"]
HIER_KW = dict(ENGINE_KW, hierarchical=True)


def matrix_specs() -> list[str]:
    """Every compressor by name, then every compressor under each scheme it declares beyond its
    own collective, then every biased one with EF21 (generic: a new compressor or scheme is covered
    without edits)."""
    from gradzip.compress import registry

    reg = registry()
    return sorted(reg) + [f"{name}:exchange={s}" for name, cls in reg.items() for s in cls.schemes
                          if s != cls.collective] + [f"{name}:ef=ef21" for name, cls in reg.items() if cls.biased]
MISMATCH = {"spec": ("topk:ratio=0.1", "topk:ratio=0.2"), "model": (24, 25)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="matrix")
    ap.add_argument("--specs", default="")
    args = ap.parse_args()
    out = Path(args.out)
    from gradzip.comm import init_communicator
    from gradzip.engine import attach
    from gradzip.errors import CommError, GradzipError

    comm = init_communicator(args.backend, timeout=60.0)
    r = comm.rank
    res: dict = {"world_size": comm.world_size, "engine": {}, "ddp": {}, "mismatch": {}, "hier": {}}
    try:
        phases = args.phases.split(",")
        if "matrix" in phases:
            for spec in (args.specs.split(";") if args.specs else matrix_specs()):
                res["engine"][spec] = train_engine(spec, comm)
        if "hier" in phases:
            os.environ["GRADZIP_NODE"] = str(r // 2)
            res["hier"] = {spec: train_engine(spec, comm, HIER_KW) for spec in HIER_SPECS}
        if "mismatch" in phases:
            for what, (_, b) in MISMATCH.items():
                spec = b if (what == "spec" and r == 1) else MISMATCH["spec"][0]
                model = make_model()
                if what == "model" and r == 1:
                    model.fc2 = nn.Linear(24, b)
                    model.head = nn.Linear(b, 5)
                try:
                    attach(model, spec, comm, **ENGINE_KW)
                    res["mismatch"][what] = "no error"
                except GradzipError as e:
                    res["mismatch"][what] = str(e)
        if "ddp" in phases:
            import torch.distributed as dist

            if dist.is_initialized():
                for spec in DDP_SPECS:
                    res["ddp"][spec] = train_ddp(spec, r)
                # A hook state built before the group existed checks the ranks when it binds.
                from gradzip.engine.ddp import GradzipHookState

                late = GradzipHookState("onebit" if r == 0 else "topk:ratio=0.1", None, DDP_KW["min_compress_numel"])
                try:
                    late.bind()
                    res["ddp_late"] = "no error"
                except GradzipError as e:
                    res["ddp_late"] = str(e)
        if "ddp_auto" in phases:
            res["ddp_auto"] = train_ddp_auto(r, out)
        if "demo" in phases:
            res["demo"] = {"standalone": train_demo(comm, True), "engine": train_demo(comm, False)}
        torch.save(res, out / f"rank{r}.pt")
        if "hang" in phases:  # last: it leaves the communicator broken
            model = make_model()
            engine = attach(model, "topk:ratio=0.2", comm, **ENGINE_KW)
            comm.timeout = 3.0
            if r == comm.world_size - 1:  # this rank hangs: never reaches the exchange
                deadline = time.monotonic() + 40
                while not (out / "hang.done").exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
                os._exit(0)  # no teardown: the peer's communicator is broken
            else:
                t0 = time.monotonic()
                try:
                    loss_of(model, batch(0, r)).backward()
                    engine.finalize()
                    res["hang"] = "no error"
                except CommError as e:
                    res["hang"] = f"{type(e).__name__}: {e}"
                res["hang_s"] = time.monotonic() - t0
                torch.save({"hang": res["hang"], "hang_s": res["hang_s"]}, out / f"rank{r}.hang.pt")
                (out / "hang.done").touch()
                sys.stdout.flush()
                os._exit(0)
        comm.close()
        return 0
    except BaseException:
        (out / f"rank{r}.err").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    sys.exit(main())
