"""``gradzip simulate --fsdp`` / ``--hsdp``: the cost model of sharded data parallelism, built from
the parts of the DDP model (:mod:`gradzip.cluster.simulate`): the engine's buckets, the network
of :mod:`gradzip.cluster.network`, the exchange schemes of :mod:`gradzip.cluster.exchanges` and the
one overlap rule of :func:`gradzip.cluster.schedule.model_step`.

Units: each engine bucket (2 of the DDP model) is one sharded unit (FSDP wraps layers; the buckets
are groups of consecutive layers). A unit of e elements is cut into s shards of c = ⌈e/s⌉ elements
(padded as FSDP pads its flat parameter): s = n (all GPUs) for FSDP, s = g (the GPUs of a node)
for HSDP. Parameters are gathered and gradients reduced in the gradient dtype (``--grad-dtype``:
FSDP's mixed precision keeps them in one dtype); master parameters and Adam's two moments are fp32.

Per step, per unit, per GPU (with ``--accumulation`` a: every micro-batch gathers the parameters;
the gradient is reduced once, in the last micro-batch, as gradzip's FSDP compression does under
``set_requires_gradient_sync(False)``, and until then it is held unsharded):

- FSDP: two all-gathers of the parameters (forward, backward; each GPU sends (n−1)·c·esize) over
  the cluster's links (hierarchical or ring: :func:`gradzip.cluster.network.allgather_time`), and
  the gradient's reduce-scatter, compressed where gradzip compresses: a compressor whose payloads
  sum (collective ``allreduce``, one round, not per-tensor: ``none``, ``fp16``, ``randomk``)
  reduce-scatters its payload of n chunks of c elements; the others send their n chunk payloads by
  an alltoall (the first half of ``twophase``) and decode the n − 1 received ones. Each GPU sends
  (n−1) chunk payloads either way; plain buckets (small tensors) reduce-scatter the gradient.
- HSDP: the two all-gathers and the reduce-scatter inside the node (g ranks, intra-node link,
  uncompressed), then the all-reduce of the 1/g shard among the nodes' replicas by the
  compressor's own collective or declared scheme (the g replica groups of a node share its NIC,
  as in the hierarchical exchange).

Overlap: the all-gathers are prefetched one unit ahead, as FSDP's forward and backward prefetch:
the gather of unit j+1 runs on the link while unit j computes (compute per unit in proportion to
its elements), so only the first gather and any gather slower than its unit's compute stall
compute. The reduce-scatters follow the DDP rule (``--overlap``, ready times and the serial link of
:func:`model_step`), sharing the link with the backward gathers, which are issued first.

Memory per GPU (GB, 1e9 bytes): parameters (fp32), gradients (gradient dtype) and optimizer state
(Adam: two fp32 moments), each divided by s for what is sharded (DDP: nothing); error memory (fp32,
compressors with error feedback) holds one copy of what is compressed: the compressed buckets'
gradient for DDP, the reduce-scatter input (the whole unit) for FSDP, the shard for HSDP. With
accumulation the gradient is unsharded (see above). Not counted: activations, the gathered unit's
transient copy, communication buffers.

Compressors that are not :func:`chunkable` (several rounds or whole matrices: PowerSGD; a payload
size that depends on the data) run, under FSDP, their own exchange of every rank's chunks (each
parameter's row block, for PowerSGD), as :mod:`gradzip.engine.fsdp` does; under HSDP, PowerSGD
compresses each parameter's shard.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import torch

from gradzip.cluster.exchanges import flat_bucket
from gradzip.cluster.network import Cluster, CodecCost, allgather_time, alltoall_time
from gradzip.cluster.schedule import BucketTiming, model_step
from gradzip.cluster.simulate import (
    DTYPES,
    BucketShape,
    Prediction,
    Workload,
    model_buckets,
    separate_small_for,
)
from gradzip.comm import cost
from gradzip.compress.base import Compressor
from gradzip.compress.ef import ErrorFeedback
from gradzip.compress.registry import create
from gradzip.errors import GradzipError

MODES = ("ddp", "fsdp", "hsdp")
GB = 1e9


@dataclass(frozen=True)
class Memory:
    """Per-GPU memory in bytes."""

    params: float
    grads: float
    optim: float
    error: float


@dataclass
class UnitCost:
    """One unit's collectives on one GPU (one micro-batch that gathers and reduces): the gather
    time (one of the two), the reduce-scatter's timing, bytes sent by each collective (flat-ring
    counts, as the DDP model's ``sent_bytes``), and of those the ones crossing nodes (as DDP
    counts them: every byte of a collective that spans nodes; HSDP: the replica all-reduce only)."""

    gather_s: float
    reduce: BucketTiming
    gather_bytes: float      # one all-gather
    reduce_bytes: float      # the (intra-node, for HSDP) reduce-scatter
    replica_bytes: float     # HSDP: the replica all-reduce among nodes (0 for FSDP)
    inter_bytes: float       # per step without accumulation, all of the unit's collectives
    inter_gather: float      # of which the two all-gathers (repeated in every micro-batch)
    payload: float           # the gradient payload the GPU puts on the wire (compressed or not)
    calls: int               # collectives per micro-batch


def check_mode(mode: str, cl: Cluster, sync_outer: bool) -> None:
    """A one-line error for a combination the sharded model cannot honour."""
    if mode not in MODES:
        raise GradzipError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "ddp":
        return
    if sync_outer:
        raise GradzipError(f"--{mode} models a per-step exchange; it cannot be combined with --sync diloco/localsgd")
    if mode == "hsdp" and cl.gpus_per_node < 2:
        raise GradzipError("--hsdp shards inside each node: it needs --gpus-per-node >= 2 "
                           f"(got {cl.gpus_per_node}; use --fsdp)")
    if mode == "hsdp" and cl.nodes < 2:
        raise GradzipError("--hsdp replicates across nodes: it needs --nodes >= 2 (got 1; use --fsdp)")


def chunkable(comp: Compressor) -> bool:
    """Whether 1-D FSDP's reduce-scatter can send ``comp``'s payloads chunk by chunk in one alltoall
    (one round, flat, a payload size that does not depend on the data). The others (PowerSGD,
    ``threshold``) run their own exchange on every rank's chunks (:mod:`gradzip.engine.fsdp`)."""
    return comp.rounds == 1 and not comp.per_tensor and comp.fixed_size


def row_blocks(shapes: tuple[tuple[int, ...], ...], s: int) -> list[tuple[int, ...]]:
    """Each parameter's shard of ``s`` (FSDP2 shards dimension 0, padded): a block of its rows."""
    return [(math.ceil(sh[0] / s), *sh[1:]) if sh else (1,) for sh in shapes]


def summable(comp: Compressor) -> bool:
    """Payloads a reduce-scatter can sum chunk by chunk (one round, elementwise mean, flat)."""
    return comp.collective == "allreduce" and comp.rounds == 1 and not comp.per_tensor


def reduce_scatter_time(nbytes: float, cl: Cluster) -> float:
    """α–β time of one reduce-scatter of an ``nbytes`` buffer per GPU over the whole cluster
    (hierarchical: inside the node, then among the nodes on the 1/g part, the g GPUs of a node
    sharing its NIC)."""
    n, g, nodes = cl.workers, cl.gpus_per_node, cl.nodes
    if n <= 1:
        return 0.0
    if cl.algorithm == "hierarchical" and g > 1 and nodes > 1:
        return (cost.reduce_scatter_time(nbytes, g, cl.intra())
                + cost.reduce_scatter_time(nbytes / g, nodes, cl.inter(share=g)))
    return cost.reduce_scatter_time(nbytes, n, cl.inter() if nodes > 1 else cl.intra())


def fsdp_unit(comp: Compressor, b: BucketShape, dtype: torch.dtype, cl: Cluster, codec: CodecCost) -> UnitCost:
    """FSDP over all n GPUs: the unit's two gathers and its (compressed) reduce-scatter."""
    n, nodes = cl.workers, cl.nodes
    esize = dtype.itemsize
    c = math.ceil(b.numel / n)
    gather = (n - 1) * c * esize
    if b.compressed and not chunkable(comp):  # the compressor's own exchange of every rank's chunks
        blocks = row_blocks(b.shapes, n) * n
        inner = flat_bucket(comp, blocks, n * c, True, dtype, cl, codec, 0.0)
        return UnitCost(
            gather_s=allgather_time(c * esize, 1, cl), reduce=inner.timing, gather_bytes=gather,
            reduce_bytes=inner.sent, replica_bytes=0.0,
            inter_bytes=2 * gather + inner.inter if nodes > 1 else 0.0, inter_gather=2 * gather if nodes > 1 else 0.0,
            payload=comp.batch_payload_bytes(blocks, dtype), calls=2 + inner.calls)
    if b.compressed and not comp.identity:
        cb = comp.payload_bytes((c,), dtype)
    else:
        cb = c * esize
    reduce_sent = (n - 1) * cb  # = reduce_scatter_bytes(n·cb, n): n − 1 chunk payloads
    if b.compressed and not summable(comp):
        t = alltoall_time(n * cb, cl)
        decode = codec.aggregate_s * (n - 1) * c
    else:
        t = reduce_scatter_time(n * cb, cl)
        decode = 0.0
    encode = codec.encode_s * b.numel if b.compressed else 0.0
    return UnitCost(
        gather_s=allgather_time(c * esize, 1, cl),
        reduce=BucketTiming(ready_s=0.0, compress_s=encode, rounds_s=[t], decode_s=decode),
        gather_bytes=gather, reduce_bytes=reduce_sent, replica_bytes=0.0,
        inter_bytes=2 * gather + reduce_sent if nodes > 1 else 0.0, inter_gather=2 * gather if nodes > 1 else 0.0,
        payload=n * cb, calls=3)


def hsdp_unit(comp: Compressor, b: BucketShape, dtype: torch.dtype, cl: Cluster, codec: CodecCost) -> UnitCost:
    """HSDP: gathers and reduce-scatter inside the node, then the shard's replica all-reduce."""
    g = cl.gpus_per_node
    esize = dtype.itemsize
    c = math.ceil(b.numel / g)
    intra = cl.intra()
    gather = (g - 1) * c * esize
    reduce_sent = cost.reduce_scatter_bytes(g * c * esize, g)
    t1 = cost.reduce_scatter_time(g * c * esize, g, intra)
    # The g replica groups of a node (one per local rank) run at once through its NIC.
    replicas = replace(cl, gpus_per_node=1, inter_bps=cl.inter_bps / g)
    shard = row_blocks(b.shapes, g) if comp.per_tensor else [(c,)]  # PowerSGD: each parameter's shard
    inner = flat_bucket(comp, shard, c, b.compressed, dtype, replicas, codec, 0.0)
    it = inner.timing
    payload = comp.batch_payload_bytes(shard, dtype) if b.compressed else c * esize
    timing = BucketTiming(ready_s=0.0, compress_s=0.0, rounds_s=[t1, sum(it.rounds_s)],
                          between_s=[it.compress_s + sum(it.between_s)], decode_s=it.decode_s)
    return UnitCost(
        gather_s=cost.allgather_time([c * esize] * g, intra), reduce=timing,
        gather_bytes=gather, reduce_bytes=reduce_sent, replica_bytes=inner.sent, inter_bytes=inner.inter,
        inter_gather=0.0, payload=payload, calls=3 + inner.calls)


def _prefetched(gathers: list[float], work: list[float]) -> float:
    """Finish time of units computed in order, each after its gather; gather j+1 starts once
    gather j is done and unit j has started computing (prefetch one unit ahead)."""
    t, gathered = 0.0, gathers[0] if gathers else 0.0
    for j, w in enumerate(work):
        start = max(t, gathered)
        t = start + w
        if j + 1 < len(gathers):
            gathered = max(gathered, start) + gathers[j + 1]
    return t


def memory(mode: str, comp: Compressor, work: Workload, cl: Cluster) -> Memory:
    """Per-GPU bytes of parameters, gradients, optimizer state and error memory (module docstring)."""
    buckets, params = model_buckets(work.model, work.vocab_size, work.bucket_cap_mb, work.min_compress_numel,
                                    separate_small_for(comp), work.grad_dtype)
    esize = DTYPES[work.grad_dtype].itemsize
    ef = isinstance(comp, ErrorFeedback)
    if mode == "ddp":
        compressed = sum(b.numel for b in buckets if b.compressed)
        return Memory(params * 4, params * esize, params * 8, compressed * 4 if ef else 0)
    s = cl.workers if mode == "fsdp" else cl.gpus_per_node
    shard = sum(math.ceil(b.numel / s) for b in buckets)
    # FSDP compresses the reduce-scatter input (the whole padded unit), HSDP the node's shard.
    held = s if mode == "fsdp" else 1
    error = sum(held * math.ceil(b.numel / s) for b in buckets if b.compressed) * 4 if ef else 0
    # Accumulating without gradient sync, FSDP keeps the unsharded gradient until the last micro-batch.
    grads = params if work.accumulation > 1 else shard
    return Memory(shard * 4, grads * esize, shard * 8, error)


def predict_sharded(spec: str, mode: str, work: Workload, cl: Cluster, codec: CodecCost | None = None,
                    tokens: float | None = None, epochs: float = 1.0) -> Prediction:
    """The step of ``mode`` (``fsdp`` or ``hsdp``) for one compressor spec (module docstring)."""
    codec = codec or CodecCost()
    comp = create(spec)
    check_mode(mode, cl, False)
    buckets, params = model_buckets(work.model, work.vocab_size, work.bucket_cap_mb, work.min_compress_numel,
                                    separate_small_for(comp), work.grad_dtype)
    unit = fsdp_unit if mode == "fsdp" else hsdp_unit
    units = [unit(comp, b, DTYPES[work.grad_dtype], cl, codec) for b in buckets]
    a = work.accumulation
    compute_mb = work.tokens_per_step / work.tokens_per_second / a
    backward = work.backward_fraction * compute_mb
    forward = compute_mb - backward
    total = sum(b.numel for b in buckets) or 1
    shares = [b.numel / total for b in buckets]  # launch (backward) order
    gathers = [u.gather_s for u in units]
    stall = (_prefetched(gathers[::-1], [forward * f for f in shares[::-1]]) - forward
             + _prefetched(gathers, [backward * f for f in shares]) - backward)
    timings = _backward_timings(units, shares, compute_mb, backward, forward, stall, work.overlap)
    modelled = model_step(compute_mb + stall, timings)  # the last micro-batch: gathers and reduce
    step = (a - 1) * (compute_mb + stall) + modelled.step_s  # earlier micro-batches only gather
    compress = modelled.compress_s
    comm = a * sum(2 * u.gather_s for u in units) + modelled.link_s - sum(gathers)  # backward gathers: in the schedule
    n, compute = cl.workers, a * compute_mb
    tps = n * work.tokens_per_step / step
    payload = sum(u.payload for u in units)
    gathered = a * sum(2 * u.gather_bytes for u in units)
    reduced = sum(u.reduce_bytes + u.replica_bytes for u in units)
    detail = {"allgather_bytes": gathered, "reduce_scatter_bytes": sum(u.reduce_bytes for u in units),
              "replica_allreduce_bytes": sum(u.replica_bytes for u in units),
              "gather_stall_s": a * stall, "compressed_elements": sum(b.numel for b in buckets if b.compressed)}
    inter = sum(u.inter_bytes + (a - 1) * u.inter_gather for u in units)
    return Prediction(
        compressor=comp.spec, exchange=exchange_label(comp, mode), hierarchical=False, workers=n, params=params,
        payload_bytes=payload, sent_bytes=gathered + reduced, inter_bytes=inter,
        compression_ratio=params * 4 / payload if payload else math.inf,
        collectives=sum(u.calls + 2 * (a - 1) for u in units) if n > 1 else 0,
        compute_s=compute, backward_s=backward, compress_s=compress, comm_s=comm,
        exposed_comm_s=step - compute - compress, step_s=step, tokens_per_s=tps,
        scaling_efficiency=compute / step,
        days=None if tokens is None else tokens * epochs / tps / 86400.0,
        detail=detail, sync="step", bytes_per_sync=payload, peak_sync_bytes=payload,
        sync_exposed_s=step - compute, compute_utilisation=compute / step)


def _backward_timings(units: list[UnitCost], shares: list[float], compute_mb: float, backward: float,
                      forward: float, stall: float, overlap: float) -> list[BucketTiming]:
    """The link's work in backward, in launch order: the backward gathers (issued a unit ahead) and
    the reduce-scatters (ready by the DDP overlap rule), both after the gather stalls."""
    out: list[tuple[float, int, BucketTiming]] = []
    done = [0.0, *itertools.accumulate(shares)]
    for i, u in enumerate(units):
        issued = forward + stall + backward * done[max(0, i - 1)]  # when unit i−1's backward starts
        out.append((issued, 0, BucketTiming(ready_s=issued, compress_s=0.0, rounds_s=[u.gather_s])))
        ready = compute_mb + stall - overlap * backward * (1.0 - done[i + 1])
        out.append((ready, 1, replace(u.reduce, ready_s=ready)))
    return [t for _, _, t in sorted(out, key=lambda x: (x[0], x[1]))]


def exchange_label(comp: Compressor, mode: str) -> str:
    """The exchange column: FSDP's reduce-scatter (``rs``) or alltoall, HSDP's replica scheme."""
    if mode == "fsdp" and chunkable(comp):
        return "rs" if summable(comp) else "alltoall"
    return comp.exchange
