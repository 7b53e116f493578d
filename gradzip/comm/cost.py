"""Bytes and α–β time of the collectives, shared by every backend's accounting, the ``sim``
backend's virtual clock and ``gradzip simulate``.

Conventions: ``n`` ranks, ``S`` bytes per rank's buffer, link bandwidth ``B`` in bits/s,
per-message latency ``α`` in seconds. Algorithms (as NCCL/Gloo/Open MPI use for large messages):

- ring allreduce: 2(n−1) steps of S/n bytes: each rank sends and receives 2(n−1)/n·S;
  time 2(n−1)·α + 2(n−1)/n·S·8/B.
- ring allgather of sizes s_0..s_{n−1}: rank r forwards every block except its successor's own:
  sends Σs − s_{r+1}, receives Σs − s_r; time (n−1)·α + (Σs − min s)·8/B
  (equal sizes: (n−1)·s per rank, (n−1)·α + (n−1)·s·8/B).
- pipelined chain broadcast from the root: every rank but the last in the chain sends S;
  time (n−1)·α + S·8/B (large-message pipelining).
- barrier: a zero-byte allreduce, 2(n−1)·α.
- ring reduce-scatter of an S-byte buffer (n chunks of S/n): the first half of the ring allreduce;
  each rank sends and receives (n−1)/n·S; time (n−1)·α + (n−1)/n·S·8/B.
- pairwise-exchange alltoall of an S-byte buffer (n chunks of S/n): each rank sends and
  receives (n−1)/n·S; time (n−1)·α + (n−1)/n·S·8/B.
- two link levels (``sim`` with several ranks per node, ``gradzip simulate``): a group inside one
  node runs on the intra-node link; a group that spans nodes is paced by the inter-node link
  (a ring or pairwise schedule crosses it at every step).
- hierarchical allreduce (``gradzip simulate``): reduce-scatter inside the node, ring allreduce
  between nodes of the node-local shard, allgather inside the node.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A network link: bandwidth in bits/s, latency (α) in seconds."""

    bandwidth_bps: float
    latency_s: float = 0.0

    def transfer(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.latency_s + nbytes * 8.0 / self.bandwidth_bps


# ---------------------------------------------------------------- bytes per rank
def allreduce_bytes(nbytes: int, n: int) -> int:
    """Bytes one rank sends (= receives) in a ring allreduce of an ``nbytes`` buffer."""
    if n <= 1:
        return 0
    return (2 * (n - 1) * nbytes) // n


def allgather_bytes(sizes: list[int], rank: int) -> tuple[int, int]:
    """(sent, received) bytes of ``rank`` in a ring allgather of per-rank sizes ``sizes``."""
    n = len(sizes)
    if n <= 1:
        return 0, 0
    total = sum(sizes)
    return total - sizes[(rank + 1) % n], total - sizes[rank]


def broadcast_bytes(nbytes: int, n: int, rank: int, src: int = 0) -> tuple[int, int]:
    """(sent, received) bytes of ``rank`` in a chain broadcast rooted at ``src``."""
    if n <= 1:
        return 0, 0
    pos = (rank - src) % n  # position in the chain
    sent = nbytes if pos < n - 1 else 0
    recv = nbytes if pos > 0 else 0
    return sent, recv


def alltoall_bytes(nbytes: int, n: int) -> int:
    """Bytes one rank sends (= receives) in an alltoall of an ``nbytes`` buffer (n equal chunks)."""
    if n <= 1:
        return 0
    return ((n - 1) * nbytes) // n


# ---------------------------------------------------------------- α–β time
def allreduce_time(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return link.transfer(2 * (n - 1) / n * nbytes, messages=2 * (n - 1))


def allgather_time(sizes: list[int], link: Link) -> float:
    n = len(sizes)
    if n <= 1:
        return 0.0
    return link.transfer(sum(sizes) - min(sizes), messages=n - 1)


def broadcast_time(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return link.transfer(nbytes, messages=n - 1)


def alltoall_time(nbytes: float, n: int, link: Link, per_node: int = 1, intra: Link | None = None) -> float:
    """Pairwise exchange. ``per_node > 1`` (a group spanning nodes, ``per_node`` of its ranks on
    each): the chunks for other nodes of all ``per_node`` ranks leave through the node's one
    ``link``, and the chunks for the node's own ranks travel on ``intra``."""
    if n <= 1:
        return 0.0
    if per_node <= 1 or intra is None:
        return link.transfer((n - 1) / n * nbytes, messages=n - 1)
    off_node = per_node * (n - per_node) / n * nbytes
    on_node = (per_node - 1) / n * nbytes
    return link.transfer(off_node, messages=n - per_node) + intra.transfer(on_node, messages=per_node - 1)


def barrier_time(n: int, link: Link) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) * link.latency_s


def hierarchical_allreduce_time(nbytes: float, nodes: int, per_node: int, inter: Link, intra: Link) -> float:
    """Reduce-scatter within a node, ring allreduce across nodes of the 1/per_node shard,
    allgather within the node. With ``per_node == 1`` this equals :func:`allreduce_time`."""
    t = 0.0
    if per_node > 1:
        shard_step = (per_node - 1) / per_node * nbytes
        t += 2 * intra.transfer(shard_step, messages=per_node - 1)  # reduce-scatter + allgather
    t += allreduce_time(nbytes / per_node, nodes, inter)
    return t


# ---------------------------------------------------------------- sharded training (FSDP, HSDP)
def reduce_scatter_bytes(nbytes: int, n: int) -> int:
    """Bytes one rank sends (= receives) in a ring reduce-scatter of an ``nbytes`` buffer (n chunks):
    the first half of a ring allreduce, (n−1)/n·S."""
    if n <= 1:
        return 0
    return ((n - 1) * nbytes) // n


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter: n−1 steps of S/n bytes, (n−1)·α + (n−1)/n·S·8/B."""
    if n <= 1:
        return 0.0
    return link.transfer((n - 1) / n * nbytes, messages=n - 1)
