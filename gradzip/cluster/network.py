"""The cluster's network as ``gradzip simulate`` models it: nodes of GPUs, a NIC per node between
nodes and a fast link inside, and the α–β time of each collective on it (formulas from
:mod:`gradzip.comm.cost`, the ones every backend accounts with)."""

from __future__ import annotations

from dataclasses import dataclass

from gradzip.comm import cost
from gradzip.errors import GradzipError

ALGORITHMS = ("hierarchical", "ring")


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    inter_bps: float
    intra_bps: float
    inter_latency_s: float = 50e-6
    intra_latency_s: float = 5e-6
    algorithm: str = "hierarchical"
    link_efficiency: float = 1.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise GradzipError(f"--nodes and --gpus-per-node must be >= 1, got {self.nodes} and {self.gpus_per_node}")
        if not (self.inter_bps > 0 and self.intra_bps > 0):
            raise GradzipError("bandwidths must be positive (e.g. 10gbit)")
        if self.inter_latency_s < 0 or self.intra_latency_s < 0:
            raise GradzipError("latencies must not be negative")
        if self.algorithm not in ALGORITHMS:
            raise GradzipError(f"unknown algorithm {self.algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
        if not 0 < self.link_efficiency <= 1:
            raise GradzipError(f"--link-efficiency must be in (0, 1], got {self.link_efficiency}")

    @property
    def workers(self) -> int:
        return self.nodes * self.gpus_per_node

    def inter(self, share: int = 1) -> cost.Link:
        return cost.Link(self.inter_bps * self.link_efficiency / share, self.inter_latency_s)

    def intra(self) -> cost.Link:
        return cost.Link(self.intra_bps * self.link_efficiency, self.intra_latency_s)



@dataclass(frozen=True)
class CodecCost:
    """Seconds per gradient element: own encode + decode, and per other rank's payload (allgather)."""

    encode_s: float = 0.0
    aggregate_s: float = 0.0
    source: str = "none (compression time not modelled)"



def allreduce_time(nbytes: float, collectives: int, cl: Cluster) -> float:
    """α–β time of ``collectives`` allreduces carrying ``nbytes`` in total (per GPU buffer)."""
    n, g, nodes = cl.workers, cl.gpus_per_node, cl.nodes
    if n <= 1 or collectives == 0:
        return 0.0
    if cl.algorithm == "hierarchical" and g > 1 and nodes > 1:
        def one(b: float, lat: bool) -> float:
            inter, intra = cl.inter(share=g), cl.intra()
            if not lat:
                inter, intra = cost.Link(inter.bandwidth_bps), cost.Link(intra.bandwidth_bps)
            return cost.hierarchical_allreduce_time(b, nodes, g, inter, intra)
        return one(nbytes, False) + collectives * one(0.0, True)
    link = cl.inter() if nodes > 1 else cl.intra()
    return (cost.allreduce_time(nbytes, n, cost.Link(link.bandwidth_bps))
            + collectives * cost.allreduce_time(0.0, n, link))


def allgather_time(nbytes: float, collectives: int, cl: Cluster) -> float:
    """α–β time of ``collectives`` allgathers in which every GPU contributes ``nbytes`` in total."""
    n, g, nodes = cl.workers, cl.gpus_per_node, cl.nodes
    if n <= 1 or collectives == 0:
        return 0.0

    def ag(size: float, ranks: int, link: cost.Link, lat: bool) -> float:
        if not lat:
            link = cost.Link(link.bandwidth_bps)
        return cost.allgather_time([int(round(size))] * ranks, link) if ranks > 1 else 0.0

    if cl.algorithm == "hierarchical" and g > 1 and nodes > 1:
        # inter-node: g concurrent rings (one per local rank) share the NIC; then intra-node
        # allgather of the nodes·s bytes each GPU received.
        def one(s: float, lat: bool) -> float:
            return ag(s, nodes, cl.inter(share=g), lat) + ag(nodes * s, g, cl.intra(), lat)
        return one(nbytes, False) + collectives * one(0.0, True)
    link = cl.inter() if nodes > 1 else cl.intra()
    return ag(nbytes, n, link, False) + collectives * ag(0.0, n, link, True)


def alltoall_time(nbytes: float, cl: Cluster) -> float:
    """α–β time of one alltoall of an ``nbytes`` buffer per GPU over the whole cluster: the chunks
    for other nodes of all g GPUs of a node leave through its NIC, the rest stay inside."""
    n, g = cl.workers, cl.gpus_per_node
    if n <= 1:
        return 0.0
    if cl.nodes == 1:
        return cost.alltoall_time(nbytes, n, cl.intra())
    return cost.alltoall_time(nbytes, n, cl.inter(), per_node=g, intra=cl.intra())
