"""A replica group for tests/test_ft.py: a small regression model trained with FTDiLoCo.

``run_group(cfg, queue)`` trains ``cfg["steps"]`` inner steps, then puts ``(group, digest, torchft
step, inner step)`` on ``queue``. Keys: lighthouse,
group, groups, min_replicas, every, spec, steps, log, guard, save/load (a checkpoint path),
pause_at/resume_file (after ``pause_at`` inner steps, wait for the file to exist), standby (a warm
spare's go file), ready_file
(written once the group's Manager is up), outer_lr/momentum, tokens (per inner step), probe (a
path prefix: the state before and after the first regular sync), fragments (Streaming DiLoCo's P),
sparseloco (a dict of ``--sync ftsparseloco`` keys: that mode, with ``spec`` ignored); rank/ranks/port
(a replica group of ``ranks`` gloo ranks, DDP inside it, its rendezvous on ``port``: this process is
``rank``; the queue's key is then ``(group, rank)``, and the probe files end in ``.rank``)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch


def _batch(group: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * group + step)
    x = torch.randn(8, 16, generator=g)
    w = torch.arange(64, dtype=torch.float32).reshape(16, 4) / 64
    return x, x @ w


def _wait(path: str, limit: float = 60.0) -> None:
    t0 = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t0 > limit:
            raise TimeoutError(path)
        time.sleep(0.02)


def run_group(cfg: dict[str, Any], queue: Any) -> None:
    torch.set_num_threads(1)
    from gradzip.engine.ftdiloco import FTDiLoCo

    rank, ranks, local = cfg.get("rank", 0), cfg.get("ranks", 1), None
    if ranks > 1:
        from gradzip.comm.torch_backend import TorchCommunicator

        local = TorchCommunicator("gloo", rank, ranks, master_addr="127.0.0.1", master_port=cfg["port"], timeout=30)
    torch.manual_seed(0)  # every group is born with the same parameters
    model = torch.nn.Linear(16, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    momentum = cfg.get("momentum", 0.9)
    outer = torch.optim.SGD(model.parameters(), lr=cfg.get("outer_lr", 0.7), momentum=momentum,
                            nesterov=momentum > 0)
    kwargs = {"groups": cfg["groups"], "group": cfg["group"], "lighthouse": cfg["lighthouse"],
              "min_replicas": cfg.get("min_replicas", 1), "timeout": cfg.get("timeout", 10.0), "log": cfg.get("log"),
              "guard": cfg.get("guard", True), "standby": cfg.get("standby"), "local": local}
    if cfg.get("sparseloco") is not None:
        from gradzip.engine.ftsparseloco import FTSparseLoCo
        from gradzip.engine.sparseloco import codec_spec
        from gradzip.plan.sync import parse_sync

        keys = ",".join(f"{k}={v}" for k, v in cfg["sparseloco"].items())
        sync = parse_sync(f"ftsparseloco:every={cfg.get('every', 2)},{keys}")
        outer = torch.optim.SGD(model.parameters(), lr=sync.alpha, momentum=0.0)
        ft: FTDiLoCo = FTSparseLoCo(model, inner, outer, sync.every, codec_spec(sync),
                                    aggregate=dict(sync.options)["aggregate"], **kwargs)
    else:
        ft = FTDiLoCo(model, inner, outer, cfg.get("every", 2), cfg.get("spec", "none"),
                      fragments=cfg.get("fragments", 1), **kwargs)
    if cfg.get("ready_file"):  # the Manager is up and heartbeating
        open(cfg["ready_file"], "w").close()
    if cfg.get("load"):
        ft.load_state_dict(torch.load(cfg["load"], weights_only=True))
    sfx = f".{rank}" if ranks > 1 else ""
    while ft.step < cfg.get("steps", 10**9):
        if cfg.get("pause_at") is not None and ft.step == cfg["pause_at"]:
            _wait(cfg["resume_file"])
        ft.ensure_joined()
        x, y = _batch(cfg["group"] + 100 * rank, ft.step)
        inner.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        ft.reduce_gradients()  # DDP inside the group (nothing with one rank)
        inner.step()
        ft.add_tokens(cfg.get("tokens", x.shape[0]))
        probe = cfg.get("probe") and ft.step + 1 == ft.plan.span  # the first regular sync: θ_local, θ_global around it
        if probe:
            torch.save({"global": [g.clone() for g in ft.global_], "weight": ft.weight,
                        "local": [p.detach().clone() for p in ft.params]}, f"{cfg['probe']}.before{sfx}")
        ft.inner_step_done()
        if probe:
            torch.save([g.clone() for g in ft.global_], f"{cfg['probe']}.after{sfx}")
    if cfg.get("save"):
        torch.save(ft.state_dict(), cfg["save"])
    key = cfg["group"] if ranks == 1 else (cfg["group"], rank)
    queue.put((key, ft.digest(), ft.ft.manager.current_step(), ft.step))
    ft.close()
    if local is not None:
        local.close()
