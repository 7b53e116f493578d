"""Per-bucket cost models of the exchange schemes for ``gradzip simulate``: the compressor's own
collective, ``twophase``, ``sparse`` (gTop-k) and the hierarchical exchange, each as the bytes a GPU
sends and a :class:`~gradzip.cluster.schedule.BucketTiming` (link time per round, encode and
decode work) that :func:`gradzip.cluster.schedule.model_step` schedules. :func:`flat_bucket` takes
a scheme's cost function from its registration (:mod:`gradzip.compress.schemes`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from gradzip.cluster.network import Cluster, CodecCost, allgather_time, allreduce_time, alltoall_time
from gradzip.cluster.schedule import BucketTiming
from gradzip.comm import cost
from gradzip.compress.base import Compressor
from gradzip.compress.registry import create
from gradzip.compress.schemes import SCHEME_NAMES, get_scheme


@functools.lru_cache(maxsize=64)
def payload_tensors_per_round(spec: str) -> tuple[int, ...]:
    """How many payload tensors (= collectives) each round of a compressed bucket sends, probed on
    a tiny bucket (a 32×32 matrix and a 32-vector)."""
    comp = create(spec)
    g = torch.Generator().manual_seed(0)
    bucket = [torch.randn(32, 32, generator=g), torch.randn(32, generator=g)]
    payload, ctx = comp.compress_batch(bucket, "probe")
    counts = [len(payload)]
    for _ in range(1, comp.rounds):
        payload = tuple(p.clone() for p in payload)
        payload, ctx = comp.next_round_batch(payload, ctx)
        counts.append(len(payload))
    return tuple(counts)



def detail_keys() -> tuple[str, ...]:
    """The link-time keys of ``ExchangeCost.detail``: ``f"{name}_s"`` per registered exchange
    scheme (:mod:`gradzip.compress.schemes`), in registration order, then ``hierarchical_s``."""
    return (*(f"{name}_s" for name in SCHEME_NAMES), "hierarchical_s")


def twophase_bucket(comp: Compressor, numel: int, dtype: torch.dtype, cl: Cluster, codec: CodecCost,
                    ready: float) -> tuple[BucketTiming, int, float]:
    """(timing, bytes sent, link seconds) of one bucket's compressed allreduce: an alltoall of n
    chunk payloads, the server's decode + re-encode of its shard, an allgather of the shards."""
    n = cl.workers
    chunk = math.ceil(numel / n)
    cb = comp.payload_bytes((chunk,), dtype)
    t1 = alltoall_time(n * cb, cl)
    t2 = allgather_time(cb, 1, cl)
    sent = cost.alltoall_bytes(n * cb, n) + (n - 1) * cb
    server = codec.aggregate_s * numel + codec.encode_s * chunk  # decode n chunks, encode the shard
    timing = BucketTiming(ready_s=ready, compress_s=codec.encode_s * numel, rounds_s=[t1, t2],
                          between_s=[server], decode_s=codec.aggregate_s * numel)
    return timing, sent, t1 + t2


def sparse_bucket(comp: Compressor, numel: int, dtype: torch.dtype, cl: Cluster, codec: CodecCost,
                  ready: float) -> tuple[BucketTiming, float, float]:
    """(timing, mean bytes sent per GPU, link seconds) of one bucket's gTop-k
    (:mod:`gradzip.engine.gtopk`): log2(p) pairwise exchanges of the k-entry set (fp32 value +
    int32 index), plus a fold and an unfold when n is not a power of two. A level whose pairs
    sit inside nodes runs on the intra-node link; one that crosses nodes sends every GPU of a node
    through its NIC at once."""
    n, g = cl.workers, cl.gpus_per_node
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    s = comp.payload_bytes((numel,), torch.float32)  # k entries of 8 bytes: fp32 value, int32 index
    rounds = []
    if extra:
        rounds.append(_pair_time(s, cl, share=min(g, extra), inside=False))
    level = 1
    while level < p:
        rounds.append(_pair_time(s, cl, share=g, inside=2 * level <= g and g % (2 * level) == 0))
        level <<= 1
    if extra:
        rounds.append(rounds[0])
    levels = len(rounds) - (2 if extra else 0)
    sent = (p * levels * s + 2 * extra * s) / n
    merge = codec.aggregate_s * 2 * (s // 8)  # each merge sums and selects 2k entries
    timing = BucketTiming(ready_s=ready, compress_s=codec.encode_s * numel, rounds_s=rounds,
                          between_s=[merge] * (len(rounds) - 1), decode_s=merge)
    return timing, sent, sum(rounds)


def _pair_time(nbytes: float, cl: Cluster, share: int, inside: bool) -> float:
    """One two-rank exchange of ``nbytes`` each way."""
    if inside or cl.nodes == 1:
        return cl.intra().transfer(nbytes)
    return cl.inter(share=share).transfer(nbytes)




@dataclass
class BucketCost:
    """One bucket's exchange on one GPU: its timing, the bytes it sends (mean over GPUs) and of
    those the ones that cross nodes, link seconds, collectives, and the ``detail`` key it adds to."""

    timing: BucketTiming
    sent: float
    inter: float
    link_s: float
    calls: int
    kind: str


def flat_bucket(comp: Compressor, shapes: Sequence[Sequence[int]], numel: int, compressed: bool,
                dtype: torch.dtype, cl: Cluster, codec: CodecCost, ready: float) -> BucketCost:
    """The engine's exchange without ``--hierarchical``: plain buckets allreduce the gradient;
    compressed ones use the compressor's scheme."""
    n = cl.workers
    esize = torch.empty((), dtype=dtype).element_size()
    if not compressed:
        nbytes = numel * esize
        t = allreduce_time(nbytes, 1, cl)
        s = cost.allreduce_bytes(nbytes, n)
        return BucketCost(BucketTiming(ready_s=ready, compress_s=0.0, rounds_s=[t]), s, s, t, 1, "allreduce_s")
    model = get_scheme(comp.exchange).cost_model()
    if model is not None and n > 1:  # a registered scheme's own cost (twophase_bucket, sparse_bucket, ...)
        timing, s, t = model(comp, numel, dtype, cl, codec, ready)
        return BucketCost(timing, s, s, t, len(timing.rounds_s), f"{comp.exchange}_s")
    per_round = payload_tensors_per_round(comp.spec)
    nbytes = comp.batch_payload_bytes(shapes, dtype)
    encode = codec.encode_s * numel
    if comp.collective == "allgather":
        s = (n - 1) * nbytes
        t = allgather_time(nbytes, sum(per_round), cl)
        decode, kind = codec.aggregate_s * (n - 1) * numel, "allgather_s"
    else:
        s = cost.allreduce_bytes(nbytes, n)
        t = allreduce_time(nbytes, sum(per_round), cl)
        decode, kind = 0.0, "allreduce_s"
    # Rounds share the bucket's link time by their number of collectives (bytes per round are
    # not separated by the compressor's formula; the sum is exact).
    rounds = [t * k / sum(per_round) for k in per_round] if sum(per_round) else [t]
    timing = BucketTiming(ready_s=ready, compress_s=encode, rounds_s=rounds,
                          between_s=[0.0] * (len(rounds) - 1), decode_s=decode)
    return BucketCost(timing, s, s, t, sum(per_round), kind)


def hierarchical_bucket(comp: Compressor, shapes: Sequence[Sequence[int]], numel: int, compressed: bool,
                        dtype: torch.dtype, cl: Cluster, codec: CodecCost, ready: float) -> BucketCost:
    """The engine's ``--hierarchical`` exchange (:mod:`gradzip.engine.hierarchical`) with g GPUs per
    node: an intra-node alltoall of the bucket, the scheme among the nodes on a 1/g shard (the g
    shards of a node share its NIC), an intra-node allgather. PowerSGD (per-tensor): an intra-node
    allreduce, the node leader's exchange (alone on the NIC), an intra-node broadcast."""
    g = cl.gpus_per_node
    if g == 1:
        return flat_bucket(comp, shapes, numel, compressed, dtype, cl, codec, ready)
    esize = torch.empty((), dtype=dtype).element_size()
    intra = cl.intra()
    if compressed and comp.per_tensor:
        size = numel * esize
        inner = flat_bucket(comp, shapes, numel, compressed, dtype, replace(cl, gpus_per_node=1), codec, 0.0)
        t1, t3 = cost.allreduce_time(size, g, intra), cost.broadcast_time(size, g, intra)
        local = cost.allreduce_bytes(size, g) + (g - 1) * size / g  # a chain broadcast: g-1 of g send
        sent_inter = inner.sent / g  # leaders only
    else:
        chunk = math.ceil(numel / g)
        inner = flat_bucket(comp, [(chunk,)], chunk, compressed, dtype,
                            replace(cl, gpus_per_node=1, inter_bps=cl.inter_bps / g), codec, 0.0)
        t1 = cost.alltoall_time(g * chunk * esize, g, intra)
        t3 = cost.allgather_time([chunk * esize] * g, intra)
        local = cost.alltoall_bytes(g * chunk * esize, g) + (g - 1) * chunk * esize
        sent_inter = inner.sent
    it = inner.timing
    timing = BucketTiming(ready_s=ready, compress_s=0.0, rounds_s=[t1, sum(it.rounds_s), t3],
                          between_s=[it.compress_s + sum(it.between_s), it.decode_s], decode_s=0.0)
    return BucketCost(timing, local + sent_inter, sent_inter, t1 + inner.link_s + t3, inner.calls + 2,
                      "hierarchical_s")
