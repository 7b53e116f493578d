"""Which ranks share a node, and the two sub-communicators a hierarchical exchange needs.

Node membership, first match wins:

1. ``GRADZIP_NODE`` (any string): set it yourself, or let gradzip's testbed launcher set it (its
   emulated hosts share one host name);
2. the launcher's node number: torchrun's ``GROUP_RANK``, Slurm's ``SLURM_NODEID``;
3. the host name and network namespace (Open MPI and MPICH give a rank's local rank,
   ``OMPI_COMM_WORLD_LOCAL_RANK`` / ``MPI_LOCALRANKID``, but no node number). The namespace tells
   the testbed's emulated hosts apart, which share this machine's host name.

The launcher's local rank (``LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_RANK``, ``MPI_LOCALRANKID``,
``SLURM_LOCALID``) orders the ranks inside a node when it is given. ``sim`` takes membership from
its ``ranks_per_node`` setting instead.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gradzip.comm.base import Communicator
from gradzip.errors import GradzipError


@dataclass
class Topology:
    """This rank's place: ``node`` (all ranks of its node, ranked by local rank) and ``cross``
    (one rank per node: those with the same local rank)."""

    node: Communicator
    cross: Communicator
    local_rank: int
    ranks_per_node: int


def node_key(environ: Mapping[str, str] | None = None) -> tuple[str, int | None]:
    """(this process's node, its local rank or None) from the environment (module docstring)."""
    env = os.environ if environ is None else environ
    local = next((env[k] for k in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
                  if env.get(k, "").strip().isdigit()), None)
    for var in ("GRADZIP_NODE", "GROUP_RANK", "SLURM_NODEID"):
        if env.get(var, "").strip():
            return f"{var}={env[var].strip()}", None if local is None else int(local)
    return f"host={socket.gethostname()}/{_netns()}", None if local is None else int(local)


def _netns() -> str:
    try:
        return os.readlink("/proc/self/ns/net")  # e.g. net:[4026531840]
    except OSError:  # not Linux
        return "net"


def colour_of(key: str) -> int:
    """A non-negative 62-bit colour for ``split`` from a node key (equal keys, equal colours)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 2


def topology(comm: Communicator, environ: Mapping[str, str] | None = None) -> Topology:
    """Split ``comm`` into node and cross-node communicators (collective: call it on every rank,
    at set-up). Every node must hold the same number of ranks."""
    sim_node = getattr(comm, "node", None)
    if sim_node is not None:  # sim: nodes from ranks_per_node; splits bind once every worker split
        world = comm.world  # type: ignore[attr-defined]
        per = world.ranks_per_node
        nodes = [g // per for g in world.members]
        if len({nodes.count(x) for x in nodes}) != 1:
            raise GradzipError(f"hierarchical exchange needs the same number of workers on every node: "
                               f"{world.n} workers do not fill nodes of {per}")
        local = nodes[:comm.rank].count(sim_node)
        node = comm.split(sim_node)
        cross = comm.split(local)
        return Topology(node, cross, local, nodes.count(sim_node))
    key, local_env = node_key(environ)
    node = comm.split(colour_of(key), key=local_env)
    sizes = comm.allgather(torch.tensor([node.world_size], dtype=torch.int64))
    counts = sorted({int(s) for s in sizes})
    if len(counts) != 1:
        raise GradzipError(f"hierarchical exchange needs the same number of ranks on every node, got node sizes "
                           f"{counts} (this rank's node: {key}); start the same number of ranks per node")
    cross = comm.split(node.rank)
    node.intra = True  # its traffic never leaves the node (counted apart in the stats)
    return Topology(node, cross, node.rank, counts[0])
