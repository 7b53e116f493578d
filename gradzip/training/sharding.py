"""``gradzip train --fsdp`` and ``--hsdp``: how BERT is sharded, and its state as checkpoints hold it.

- ``--fsdp``: one ``fully_shard`` per encoder layer, then the root (embeddings, pooler, heads;
  the tied decoder weight stays with the word embeddings), over all ranks. gradzip compresses the
  reduce-scatter.
- ``--hsdp --ranks-per-node K``: a 2-D mesh (replicas × K), ranks ``r // K`` forming a node. Every
  module is sharded over its node's K ranks (FSDP's exact reduce-scatter on the fast bus), and
  gradzip compresses the all-reduce of each shard across the nodes.

Checkpoints keep the format of the other modes: rank 0's file holds the *full* model and optimizer
state (gathered with ``torch.distributed.checkpoint.state_dict``'s ``full_state_dict``), and each
rank's own file its compressor state (error memory per shard). On resume every rank reads the full
state and keeps its shard, so the model in a checkpoint of a sharded run also loads into an
unsharded BERT.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from gradzip.comm.cost import allreduce_bytes, reduce_scatter_bytes
from gradzip.errors import GradzipError

_LOCAL_SIZE = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def ranks_per_node(given: int | None, world: int, from_launcher: bool = True) -> int:
    """``--hsdp``'s node size: ``--ranks-per-node``, else (``from_launcher``) the launcher's local
    world size. One line unless it divides the world size into two nodes or more: one node would
    replicate across nothing, so nothing would be compressed (``gradzip simulate --hsdp`` refuses
    one node too)."""
    k = given
    if k is None and from_launcher:
        k = next((int(os.environ[v]) for v in _LOCAL_SIZE if os.environ.get(v, "").isdigit()), None)
    if k is None and not from_launcher:  # ranks this command starts itself: all on this machine
        raise GradzipError(f"--hsdp replicates across nodes: it needs >= 2 nodes, and the {world} ranks started "
                           f"here form one unless told otherwise; pass --ranks-per-node K (a divisor of {world} "
                           "below it), or use --fsdp")
    if k is None:
        raise GradzipError("--hsdp needs the node size: pass --ranks-per-node K (the ranks that share a fast bus)")
    if k < 1 or world % k:
        raise GradzipError(f"--hsdp --ranks-per-node {k} does not divide the world size {world}: every node "
                           "holds the same number of ranks; pass a divisor of the world size")
    if world // k < 2:
        what = f"--ranks-per-node {k}" if given is not None else f"the launcher's {k} ranks per node"
        raise GradzipError(f"--hsdp replicates across nodes: it needs >= 2 nodes (got 1: {what} in a world of "
                           f"{world}); pass a smaller --ranks-per-node that divides {world}, or use --fsdp")
    return k


def shard_model(model: nn.Module, sharding: str, world: int, k: int | None, device: torch.device) -> Any:
    """Shard ``model`` (a :class:`gradzip.models.BertForPreTraining`) in place; returns the replica
    group for HSDP (``fsdp_compress``'s ``replicate``), None for 1-D FSDP. Collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if sharding == "hsdp":
        k = ranks_per_node(k, world)
        mesh = init_device_mesh(device.type, (world // k, k), mesh_dim_names=("replicate", "shard"))
        shard_mesh, replicas = mesh["shard"], mesh["replicate"].get_group()
    else:
        shard_mesh, replicas = init_device_mesh(device.type, (world,)), None
    for layer in model.bert.encoder.layer:  # type: ignore[union-attr]
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return replicas


def fp32_reduction_bytes(n_params: int, sharding: str, world: int, k: int | None) -> int:
    """Bytes one rank sends per step to reduce fp32 gradients uncompressed: a ring allreduce
    (replicated), a reduce-scatter (FSDP), or one inside the node and an allreduce of the shard
    across the replicas (HSDP). FSDP's padding of the shards is left out (a few elements per rank)."""
    nbytes = 4 * n_params
    if sharding == "fsdp":
        return reduce_scatter_bytes(nbytes, world)
    if sharding == "hsdp":
        k = ranks_per_node(k, world)
        return reduce_scatter_bytes(nbytes, k) + allreduce_bytes(nbytes // k, world // k)
    return allreduce_bytes(nbytes, world)


def is_sharded(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, main: bool) -> tuple[dict, dict]:
    """The model's and optimizer's full state dicts on rank 0 (``main``); empty elsewhere. A sharded
    model gathers them (collective: every rank calls it)."""
    if not is_sharded(model):
        return (model.state_dict(), optimizer.state_dict()) if main else ({}, {})
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizer, options=opts)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Load :func:`full_state`'s dicts (read by every rank); a sharded model keeps its shard."""
    if not is_sharded(model):
        model.load_state_dict(model_sd)
        optimizer.load_state_dict(optim_sd)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_sd, options=opts)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)
