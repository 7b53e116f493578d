"""``gradzip.engine.fsdp_compat``: what fsdp_compress installs through FSDP2's public setters, and
what it needs of torch. In one process (a 1-rank gloo group): which communication each FSDP
module has after attach, after ``remove()`` and after ``FSDPSync.detach()``; the error for a torch
without the setters; the error for a module of several parameter groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradzip
from gradzip.engine import fsdp_compat
from gradzip.errors import GradzipError


@pytest.fixture()
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded(mesh=None, shard_placement_fn=None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Linear(8, 4))
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh, shard_placement_fn=shard_placement_fn)
    fully_shard(model, mesh=mesh)
    return model


def communication(units: list[fsdp_compat.FSDPUnit]) -> list[tuple]:
    """(reduce-scatter, all-reduce hook, all-gather) of each unit now."""
    return [(now.reduce_scatter, now.all_reduce_hook, now.all_gather) for now in (u.installed() for u in units)]


# -- torch without the API --------------------------------------------------------------------------
def test_a_torch_without_the_setters_is_one_error_naming_its_version(monkeypatch) -> None:
    class OldFSDPModule(nn.Module):  # FSDP2 as it was before its custom-collective setters
        def _get_fsdp_state(self):
            raise AssertionError("not reached")

    monkeypatch.setattr(fsdp_compat, "FSDPModule", OldFSDPModule)
    assert fsdp_compat.missing_api() == [f"FSDPModule.{name}" for name in fsdp_compat.SETTERS]
    with pytest.raises(GradzipError) as e:
        gradzip.fsdp_compress(nn.Linear(2, 2), "topk:ratio=0.5")
    msg = str(e.value)
    assert f"torch {torch.__version__} lacks FSDPModule.set_custom_reduce_scatter, FSDPModule.set_all_reduce_hook, " \
           "FSDPModule.set_custom_all_gather" in msg
    assert "\n" not in msg


def test_a_torch_without_fsdp2_is_the_same_error(monkeypatch) -> None:
    monkeypatch.setattr(fsdp_compat, "FSDPModule", None)
    with pytest.raises(GradzipError, match=r"lacks torch\.distributed\.fsdp\.FSDPModule .*install a newer torch"):
        gradzip.fsdp_compress(nn.Linear(2, 2), "none")


def test_this_torch_has_the_api() -> None:
    assert fsdp_compat.missing_api() == []
    fsdp_compat.require_api()


# -- what is installed, and what remove() restores -------------------------------------------------
@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_remove_restores_fsdps_own_reduce_scatter(one_rank) -> None:
    model = sharded()
    own = communication(fsdp_compat.fsdp_units(model))  # FSDP's own
    comp = gradzip.fsdp_compress(model, "topk:ratio=0.5,ef=true")
    assert [u.key for u in comp.units] == ["0", "1"]  # the root manages no parameters of its own
    for (rs, hook, ag), (_, hook0, ag0) in zip(communication(comp.units), own):
        assert type(rs).__name__ == "_GradzipReduceScatter" and rs.owner is comp
        assert hook is hook0 is None and ag is ag0
    comp.remove()
    assert all(a is b for now, was in zip(communication(comp.units), own) for a, b in zip(now, was))
    assert type(own[0][0]).__name__ == "DefaultReduceScatter"


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_hsdp_remove_restores_the_all_reduce_hook_and_detach_the_all_gather(one_rank) -> None:
    from gradzip.engine.fsdp_sync import FSDPSync

    model = sharded()
    own = communication(fsdp_compat.fsdp_units(model))
    comp = gradzip.fsdp_compress(model, "topk:ratio=0.5,ef=true", replicate=dist.new_group([0]))
    sync = FSDPSync(model, comp, 0)
    for (rs, hook, ag), (rs0, _, ag0) in zip(communication(comp.units), own):
        assert callable(hook)  # gradzip's replica all-reduce
        assert type(rs).__name__ == "_CountingReduceScatter" and rs.inner is rs0  # FSDP's own, counted
        assert type(ag).__name__ == "_CountingAllGather" and ag.inner is ag0
    model(torch.randn(3, 6)).sum().backward()  # one rank: FSDP skips its collectives, runs the hook
    assert comp.reduce_s > 0 and sync.synchronize().by_collective["allreduce"] == 0  # nothing to send to
    sync.detach()
    assert all(a is b for now, was in zip(communication(comp.units), own) for a, b in zip(now, was))


# -- a module of several parameter groups ------------------------------------------------------
def several_groups() -> nn.Module:
    """Each layer's bias on a mesh of its own process group: FSDP2 gives such a layer two groups."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    other = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group([0]), "cpu"), shard_mesh_dim=0)
    return sharded(shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), other) if p.ndim == 1 else None)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_module_of_several_parameter_groups_is_one_error(one_rank) -> None:
    model = several_groups()
    assert [len(fsdp_compat.param_groups(m)) for m in model] == [1, 2]  # layer 0 has no bias
    with pytest.raises(GradzipError) as e:
        gradzip.fsdp_compress(model, "topk:ratio=0.5")
    assert str(e.value) == ("fsdp_compress: module '1' has 2 FSDP parameter groups (a per-parameter mesh from "
                            "fully_shard's shard_placement_fn), and FSDP2's custom collectives serve a module of "
                            "one group only; shard that module on one mesh")
    fsdp_compat.check_one_group("0", model[0])  # one group: no error
    with pytest.raises(GradzipError, match="module '1' has 2 FSDP parameter groups"):
        fsdp_compat.check_one_group("1", model[1])
    # nothing was installed on the modules before the error
    groups = [fsdp_compat.FSDPUnit(str(i), m, pg) for i, m in enumerate(model) for pg in fsdp_compat.param_groups(m)]
    assert all(type(u.installed().reduce_scatter).__name__ == "DefaultReduceScatter" for u in groups)
