"""The executable "which files" table (docs/layout.md): a plug-in module registers an optimizer, an
exchange scheme, a compressor declaring that scheme and a sync mode, each with one call, and every
user picks them up: the train parser and config check, the optimizer builder, the cost model
(``gradzip simulate``), the engine and the runner (``gradzip train``). Everything is unregistered
afterwards."""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import sys
import textwrap
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from torch import nn

from gradzip.cli import main
from gradzip.cluster import simulate as sim
from gradzip.cluster.exchanges import flat_bucket
from gradzip.comm.sim import SimWorld
from gradzip.compress import create, registry
from gradzip.compress.base import SCHEMES
from gradzip.compress.registry import unregister
from gradzip.compress.schemes import SCHEME_NAMES, unregister_scheme
from gradzip.engine import attach
from gradzip.engine.modes import unregister_sync
from gradzip.optim import build_optimizer, unregister_optimizer
from gradzip.training.cli import add_arguments
from gradzip.training.config import OPTIMIZERS, TrainConfig

PLUGIN = '''
"""An optimizer, an allgather-like exchange scheme with its own cost, and a compressor using it."""
import torch

from gradzip.cluster.schedule import BucketTiming
from gradzip.compress.registry import register
from gradzip.compress.scaledsign import ScaledSign
from gradzip.compress.schemes import Scheme, register_scheme
from gradzip.engine.diloco import DiLoCo
from gradzip.engine.exchange import Exchange
from gradzip.engine.modes import register_sync
from gradzip.optim import register_optimizer

EXCHANGES = []   # (key, state) of every bucket the dummy scheme exchanged
SETUPS = []      # world size of every per-rank set-up
PRICED = []      # numel of every bucket the cost model priced with dummy_cost
LINK_S = 0.25    # the link seconds dummy_cost charges a bucket (exact in binary)


def dummy_sgd(groups, lr, weight_decay, freeze_step, momentum):
    for g in groups:
        g.pop("adapt")
    return torch.optim.SGD(groups, lr=lr, momentum=momentum)


def dummy_setup(compressor, comm):
    SETUPS.append(comm.world_size)
    return ("dummy-state", comm.world_size)


class DummyExchange(Exchange):
    """The compressor's own allgather, reached through the scheme registry."""

    def __init__(self, compressor, state, comm, tensors, key):
        EXCHANGES.append((key, state))
        super().__init__(compressor, comm, tensors, key)


def dummy_cost(comp, numel, dtype, cl, codec, ready):
    PRICED.append(numel)
    timing = BucketTiming(ready_s=ready, compress_s=0.0, rounds_s=[LINK_S])
    return timing, 3.0 * numel, LINK_S


BUILT = []       # the options every build of the dummy sync mode was given


def build_dummy_outer(model, optimizer, target, settings):
    """Parameter averaging every H steps with an outer step of lr ``scale`` (a plugin's own key)."""
    BUILT.append(dict(settings.sync.options))
    params = [p for p in model.parameters() if p.requires_grad]
    outer = torch.optim.SGD(params, lr=float(dict(settings.sync.options).get("scale", 1.0)))
    e = settings.engine
    return DiLoCo(model, optimizer, outer, target, settings.sync.every, settings.spec, agree=e.agree,
                  min_compress_numel=e.min_compress_numel, bucket_cap_mb=e.bucket_cap_mb, hook=False)


register_sync("dummyouter", "a plugin's parameter averaging (every=H,scale=S)", build_dummy_outer,
              keys=("every", "scale"))
register_optimizer("dummy", dummy_sgd, help="dummy: plain SGD from a plugin module")
register_scheme(Scheme("dummy", exchange=DummyExchange, setup=dummy_setup, cost=dummy_cost))


@register("dummysign")
class DummySign(ScaledSign):
    schemes = ("allgather", "dummy")
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch) -> Iterator[ModuleType]:
    (tmp_path / "gz_dummy_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry()  # the built-in compressors first, as in any run
    mod = importlib.import_module("gz_dummy_plugin")
    try:
        yield mod
    finally:
        unregister("dummysign")
        unregister_sync("dummyouter")
        unregister_scheme("dummy")
        unregister_optimizer("dummy")
        sys.modules.pop("gz_dummy_plugin", None)


def test_registered_optimizer_reaches_parser_config_and_builder(plugin):
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--optimizer", "dummy"]).optimizer == "dummy"
    assert "dummy: plain SGD from a plugin module" in " ".join(p.format_help().split())
    assert list(OPTIMIZERS)[-1] == "dummy" and "dummy" in OPTIMIZERS
    TrainConfig(optimizer="dummy").validate()
    model = nn.Linear(4, 3)
    opt = build_optimizer("dummy", model, lr=0.5, weight_decay=0.01, momentum=0.9)
    assert type(opt) is torch.optim.SGD
    assert [(g["lr"], g["momentum"], g["weight_decay"], len(g["params"])) for g in opt.param_groups] == \
        [(0.5, 0.9, 0.01, 1), (0.5, 0.9, 0.0, 1)]
    with pytest.raises(ValueError, match=r"choose adamw, lamb, sgd, onebit-adam, onebit-lamb, demo or dummy$"):
        build_optimizer("nope", model, lr=0.5, weight_decay=0.0)


def test_registered_scheme_is_priced_by_its_own_cost(plugin):
    assert tuple(SCHEMES) == ("allreduce", "allgather", "twophase", "sparse", "dummy") == tuple(SCHEME_NAMES)
    comp = create("dummysign:exchange=dummy")
    assert comp.exchange == "dummy"
    cl = sim.Cluster(2, 1, 1e9, 1e10)
    bc = flat_bucket(comp, [(64, 64)], 4096, True, torch.float32, cl, sim.CodecCost(), 0.5)
    assert (bc.kind, bc.sent, bc.link_s, bc.calls, bc.timing.rounds_s, bc.timing.ready_s) == \
        ("dummy_s", 3.0 * 4096, 0.25, 1, [0.25], 0.5)
    del plugin.PRICED[:]
    work = sim.Workload(model="bert-tiny", tokens_per_second=1000.0, batch_size=8, seq_len=64)
    pred = sim.predict("dummysign:exchange=dummy", work, cl)
    keys = [k for k in pred.detail if k.endswith("_s")]
    assert keys == ["allreduce_s", "allgather_s", "twophase_s", "sparse_s", "dummy_s", "hierarchical_s"]
    assert plugin.PRICED and pred.detail["dummy_s"] == 0.25 * len(plugin.PRICED)
    assert pred.detail["allgather_s"] == 0.0 and pred.detail["allreduce_s"] > 0.0  # small tensors: plain
    assert pred.detail["compressed_elements"] == sum(plugin.PRICED)
    # One GPU: nothing to exchange with, the scheme's cost is not asked.
    del plugin.PRICED[:]
    sim.predict("dummysign:exchange=dummy", work, sim.Cluster(1, 1, 1e9, 1e10))
    assert plugin.PRICED == []


def _step(engine, model: nn.Module) -> tuple[list[torch.Tensor], int]:
    """(the averaged gradients, bytes sent) of one step of three workers."""
    for w in engine.worker_ids:
        with engine.worker(w):
            g = torch.Generator().manual_seed(100 + w)
            x, y = torch.randn(5, 24, generator=g), torch.randn(5, 16, generator=g)
            nn.functional.mse_loss(model(x), y).backward()
    stats = engine.finalize()
    return [p.grad.clone() for p in model.parameters()], stats.bytes_sent


def test_engine_exchanges_through_the_registered_scheme(plugin):
    torch.manual_seed(0)
    model = nn.Linear(24, 16)
    ref = copy.deepcopy(model)
    engine = attach(model, "dummysign:exchange=dummy", SimWorld(3), min_compress_numel=64)
    plain = attach(ref, "dummysign", SimWorld(3), min_compress_numel=64)  # its own allgather
    assert plugin.SETUPS == [3, 3, 3]  # one per rank
    (got, sent), (want, sent_plain) = _step(engine, model), _step(plain, ref)
    keys = {k for k, _ in plugin.EXCHANGES}
    assert len(plugin.EXCHANGES) == 3 * len(keys) and len(keys) >= 1  # every rank, every compressed bucket
    assert {s for _, s in plugin.EXCHANGES} == {("dummy-state", 3)}
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert sent == sent_plain > 0


def test_registered_sync_mode_reaches_config_cost_model_and_runner(plugin, tmp_path, corpus, capsys):
    from gradzip.plan.sync import parse_sync

    sync = parse_sync("dummyouter:every=2,scale=1")
    assert (sync.mode, sync.every, sync.options, sync.outer) == ("dummyouter", 2, (("scale", "1"),), True)
    assert str(sync) == "dummyouter:every=2,scale=1"
    TrainConfig(sync="dummyouter:every=2,scale=1").validate()
    with pytest.raises(Exception, match=r"--sync dummyouter has no parameter 'alpha'"):
        parse_sync("dummyouter:every=2,alpha=0.5")
    # the cost model: an outer mode that sends every H steps costs less per step than every step
    work = sim.Workload(model="bert-tiny", tokens_per_second=1000.0, batch_size=8, seq_len=64)
    cl = sim.Cluster(4, 1, 1e8, 1e10)
    outer, step = sim.predict("none", work, cl, sync="dummyouter:every=2"), sim.predict("none", work, cl)
    assert outer.sync == "dummyouter:every=2" and outer.syncs_per_step == 0.5 and 0 < outer.sent_bytes < step.sent_bytes
    # the runner: gradzip train builds it through the registry and writes its spelling in the summary
    out = tmp_path / "run"
    rc = main(["train", "--model", "bert-tiny", "--seq-len", "64", "--batch-size", "4", "--workers", "2",
               "--eval-batches", "1", "--eval-every", "4", "--steps", "4", "--no-progress", "--corpus", str(corpus),
               "--sync", "dummyouter:every=2,scale=1", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert plugin.BUILT == [{"scale": "1"}]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sync"] == "dummyouter:every=2,scale=1" and summary["bytes_total"] > 0
