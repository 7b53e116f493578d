"""Every registered sync mode (:mod:`gradzip.engine.modes`) is built through the registry alone and
serves the protocol's loop (:mod:`gradzip.engine.synchronizer`): a new mode is covered here without
editing this file. ``gradzip train`` builds its synchroniser by one lookup and its loop tests no mode."""

from __future__ import annotations

import ast
import contextlib
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from gradzip.comm import spawn_local
from gradzip.comm.cost import allreduce_bytes, reduce_scatter_bytes
from gradzip.comm.sim import SimWorld
from gradzip.engine.config import EngineConfig
from gradzip.engine.modes import SyncSettings, build_synchronizer, load_modes
from gradzip.engine.synchronizer import Synchronizer
from gradzip.plan.sync import parse_sync

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SHARDED = {"fsdp": 2, "hsdp": 4, "sparseloco+hsdp": 4}  # ranks per launch: 1-D FSDP, and a 2x2 HSDP mesh
# (an outer mode on a sharded model: MODE+SHARDING, selected by --sync MODE with the sharding flag)
SELECTED_BY_FLAG = {"auto": {"spec": "auto"}}  # modes that no --sync spelling selects, and how to select them
# one process per replica group, meeting at a torchft Lighthouse: the protocol is tested on gloo in test_ft.py
PER_PROCESS = {"ftdiloco", "ftsparseloco"}


class Stepper:
    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt, self.steps, self.skips = opt, 0, 0

    def step(self, clip: bool = True) -> float:
        self.steps += 1
        self.opt.step()
        return 0.0

    def skip(self) -> None:
        self.skips += 1


def settings_for(name: str) -> SyncSettings:
    """Settings that select mode ``name``, whatever it is: a ``--sync`` spelling gets every=2."""
    mode = load_modes()[name]
    engine = EngineConfig(min_compress_numel=0)
    if mode.keys is not None:
        sync = parse_sync(f"{name}:every=2" if "every" in mode.keys else name)
        return SyncSettings(spec="topk:ratio=0.5,ef=true", sync=sync, engine=engine)
    if name in SHARDED:
        return SyncSettings(sharding=name)
    assert name in SELECTED_BY_FLAG, f"mode {name!r} is chosen by a flag: add how to select it to SELECTED_BY_FLAG"
    return SyncSettings(engine=engine, **SELECTED_BY_FLAG[name])


def _loop(sync: Synchronizer, model: nn.Module, stepper: Stepper, steps: int) -> list[float]:
    sent = []
    for step in range(steps):
        for w in sync.worker_ids:
            with sync.worker(w):
                g = torch.Generator().manual_seed(100 * step + w)
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
                with contextlib.nullcontext():
                    ((model(x) - y) ** 2).mean().backward()
                sync.after_backward(stepper)
        stats = sync.synchronize()
        sync.commit(stats.nonfinite, stepper)
        sent.append(float(stats.bytes_sent))
    return sent


@pytest.mark.parametrize("name", sorted(set(load_modes()) - set(SHARDED) - PER_PROCESS))
def test_every_registered_mode_serves_the_protocol_on_sim(name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = build_synchronizer(model, opt, SimWorld(2), settings_for(name))
    assert isinstance(sync, Synchronizer) and sync.worker_ids == [0, 1] and sync.spec and sync.exchange
    stepper = Stepper(opt)
    sent = _loop(sync, model, stepper, 4)
    assert stepper.skips == 0 and stepper.steps in (4, 8)  # per-step modes step once, local-step ones per worker
    assert sum(sent) > 0 and any(not torch.equal(p, q) for p, q in zip(before, model.parameters()))
    assert sync.eval_on_every_rank is False  # a replicated model evaluates on rank 0
    json.dumps(sync.summary())  # its own summary fields are JSON
    n = sum(p.numel() for p in model.parameters())
    assert sync.fp32_bytes(n) == allreduce_bytes(4 * n, 2)
    sync.detach()


@pytest.mark.parametrize("name", sorted(PER_PROCESS))
def test_per_process_modes_refuse_sim_in_one_line(name):
    from gradzip.errors import GradzipError

    model = nn.Linear(8, 4)
    with pytest.raises(GradzipError, match="runs each replica group on real ranks"):
        build_synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), SimWorld(2), settings_for(name))


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(SHARDED))
def test_sharded_modes_serve_the_protocol_on_gloo(name, tmp_path):
    n = SHARDED[name]
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    rc = spawn_local("gloo", n, ["--out", str(tmp_path), "--sharding", name], env_extra=env, timeout=120.0,
                     module="_sync_modes_worker", grace=5.0)
    errs = {p.name: p.read_text() for p in tmp_path.glob("rank*.err")}
    assert rc == 0 and not errs, f"{name} x{n} failed (exit {rc}): {errs}"
    for r in range(n):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["protocol"] and res["worker_ids"] == [r] and res["steps"] == 2 and res["summary"] == {}
        assert res["eval_on_every_rank"] is True and all(s > 0 for s in res["sent"])
        nbytes = 4 * res["n_params"]
        want = (reduce_scatter_bytes(nbytes, n) if name == "fsdp"
                else reduce_scatter_bytes(nbytes, 2) + allreduce_bytes(nbytes // 2, n // 2))
        assert res["fp32_bytes"] == want


def test_make_synchronizer_is_a_lookup_and_the_loop_tests_no_mode():
    sync_src = (REPO / "gradzip/training/sync.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(sync_src))
              if isinstance(n, ast.FunctionDef) and n.name == "make_synchronizer")
    assert not any(isinstance(n, (ast.If, ast.IfExp)) for n in ast.walk(fn))
    loop = (REPO / "gradzip/training/loop.py").read_text()
    for needle in ("cfg.sharding ==", "cfg.sharding !=", "is_auto", "sync_spec.outer", "getattr(sync", "FSDPSync",
                   "DiLoCo("):
        assert needle not in loop, needle
