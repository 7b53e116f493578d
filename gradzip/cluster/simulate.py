"""``gradzip simulate``: predict the step time of data-parallel BERT training on a cluster of any
size from a cost model (nothing is trained; runs in a second on a laptop).

Per step and per GPU (every GPU does the same work, so one is enough):

1. compute_s = batch_size · seq_len · accumulation / tokens_per_second — forward + backward +
   optimizer of the GPU's micro-batches at the single-GPU throughput you measured (a flag).
2. Gradients: the shapes of every parameter from the model configuration
   (:func:`gradzip.cluster.models.model_shapes`: BERT's, or a LLaMA-style decoder's), bucketed
   exactly as the engine does
   (:func:`gradzip.plan.buckets.assign_buckets`: reverse order, ``bucket_cap_mb``, tensors under
   ``min_compress_numel`` elements in plain buckets sent uncompressed).
3. Payload bytes of each bucket from the compressor's own formula
   (``compressor.batch_payload_bytes``); plain buckets send their gradient dtype's bytes.
4. compress_s = encode_cost · (elements in compressed buckets)
   + aggregate_cost · (n − 1) · (elements in compressed buckets)   [allgather compressors only:
   each other rank's payload is decoded into a dense tensor and summed].
   Costs in seconds per element, measured by ``gradzip bench compress --json`` or given.
5. comm_s: α–β time of the collectives (:mod:`gradzip.comm.cost`), one per payload tensor per
   round (multi-round compressors such as PowerSGD: every round is a collective):

   - ring allreduce over n GPUs:  2(n−1)·α + 2(n−1)/n · S · 8 / B
   - ring allgather over n GPUs:  (n−1)·α + (n−1) · s · 8 / B
   - hierarchical (default): intra-node reduce-scatter, inter-node ring allreduce of the
     1/g shard, intra-node allgather (allgather: inter-node ring, then intra-node allgather).
     The node's NIC is shared by its g GPUs, whose g inter-node rings run concurrently, so each
     gets B_inter / g. With one GPU per node, hierarchical equals ring.
   - a flat ring across nodes runs at the speed of its inter-node hops (B_inter, α_inter);
     within one node at B_intra, α_intra.
   - exchange schemes and ``--hierarchical``: :mod:`gradzip.cluster.exchanges` (``twophase``: an
     alltoall whose off-node chunks share the NIC, then an allgather; ``sparse``: log2 n pairwise
     exchanges; hierarchical: intra-node alltoall/allgather around the scheme on a 1/g shard).
   - B is the link bandwidth times ``link_efficiency`` (framing: TCP/IPv4 over Ethernet at MTU
     1500 carries 1448 payload bytes per 1514-byte frame, 0.956).
6. Overlap, by the one step-time model that the ``sim`` backend's clock also uses
   (:func:`gradzip.cluster.schedule.model_step`): backward_s = backward_fraction · compute_s /
   accumulation is the backward of the last micro-batch; bucket i (in launch order, holding a
   cumulative fraction f_i of the elements) is ready at compute_s − overlap · backward_s · (1 − f_i),
   is encoded on the compute thread (which delays the rest of backward), and its collectives
   queue on one serial link; allgather decodes run on the compute thread after backward. With
   ``overlap = 0`` every bucket waits for the end of backward: step = compute + the serial
   schedule of encode and link.
7. step_s from that schedule; exposed_comm_s = step_s − compute_s − compress_s; cluster tokens/s =
   n · tokens per step / step_s; scaling efficiency = (cluster tokens/s) / (n · tokens_per_second)
   = compute_s / step_s; days = tokens · epochs / cluster tokens/s / 86400.
8. ``--sync`` (:mod:`gradzip.plan.sync`): ``step`` (default) is 1–7. The outer modes
   ``diloco:every=H,...,fragments=P,delay=τ`` and ``localsgd:every=H`` (the same traffic: a tensor
   of the parameters' size and shapes every H steps) replace the gradient exchange:

   - an inner step is compute_s alone (no exchange, no per-step compression);
   - fragments: the buckets of 2, in launch order, cut into P contiguous groups of about equal
     elements (:func:`split_fragments`, the DiLoCo engine's rule; a bucket is the smallest unit,
     so the groups differ by up to a bucket). One sync of a fragment sends its buckets' payloads
     by the collectives of 3–5 and costs codec_s (encode, between rounds, decode: the compute
     thread) and link_s (every round of every bucket); as the engine's ``sim`` clock charges it,
     encoding does not pipeline with the link within a sync;
   - the outer step's local work (pseudo-gradient, outer optimizer, copy back) is a
     memory-bound pass of 12 fp32 accesses per parameter of the fragment (``OUTER_ACCESSES``;
     LocalSGD needs fewer) at ``--memory-bandwidth``; not charged without that flag;
   - exposure: a fragment is sent τ inner steps before it is applied, so its link time hides
     behind them: exposed_f = codec_s + max(0, link_s − τ · compute_s) + outer local work
     (codec and local work stay on the compute thread; τ = 0: fully exposed). τ < H/P, so a
     fragment has arrived before the next one is sent: the link never queues two fragments;
   - ``overlap=1``: each fragment's exchange travels during the next H inner steps (its outer step is
     applied one round late), the P fragments one after another on the link: a period's exposed
     link time is max(0, Σ_f link_f − H · compute_s), so with codec and local work left out a round
     takes max(H · compute_s, Σ_f link_f) instead of their sum (the ``sim`` backend's clock
     charges the same, a first-in first-out link);
   - a period of H steps takes H · compute_s + Σ_f exposed_f. Per step (means over the period):
     step_s = that / H; bytes = Σ_f payload_f / H (one sync of all P fragments sends what one
     per-step exchange sends); compress_s, comm_s (link), exposed_comm_s and outer_s are Σ_f / H;
     compute utilisation = H · compute_s / period = compute_s / step_s (the efficiency of 7).
   - a mode registered with a codec of its own (``sparseloco``: :func:`gradzip.plan.sync.mode_codec`)
     sends every parameter (``min_compress_numel`` = 0) through that codec in place of the
     compressor, which must be ``none`` (as ``gradzip train`` refuses one).

Ignored on purpose: stragglers and jitter, contention between compression kernels and
communication, congestion beyond the per-node NIC, the optimizer step's own scaling (it is part of
tokens_per_second), and start-up (checkpoints, evaluation); for the outer modes also the memory
of the outer state and any change in how many steps training needs to reach the same loss.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field, replace

import torch

from gradzip.cluster.exchanges import (  # noqa: F401 - re-exported: the per-bucket models
    detail_keys,
    flat_bucket,
    hierarchical_bucket,
    payload_tensors_per_round,
    sparse_bucket,
    twophase_bucket,
)
from gradzip.cluster.models import model_shapes
from gradzip.cluster.network import (  # noqa: F401 - re-exported: the network model
    ALGORITHMS,
    Cluster,
    CodecCost,
    allgather_time,
    allreduce_time,
    alltoall_time,
)
from gradzip.cluster.schedule import BucketTiming, model_step
from gradzip.compress.base import Compressor
from gradzip.compress.registry import create
from gradzip.errors import GradzipError
from gradzip.plan.buckets import MiB, assign_buckets, fragment_cap, split_fragments
from gradzip.plan.sync import SyncSpec, mode_codec, parse_sync

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# The outer step's local work in fp32 accesses per parameter (DiLoCo, Nesterov): Δ = θ_g − θ
# (read 2, write 1), m = μm + Δ (2, 1), θ_g −= lr(Δ + μm) (3, 1), θ = θ_g (1, 1).
OUTER_ACCESSES = 12


@dataclass(frozen=True)
class Workload:
    model: str
    tokens_per_second: float  # one GPU, alone: forward + backward + optimizer
    batch_size: int = 32      # per GPU micro-batch
    seq_len: int = 128
    accumulation: int = 1
    overlap: float = 0.0
    backward_fraction: float = 2 / 3
    bucket_cap_mb: float = 25.0
    min_compress_numel: int = 1024
    grad_dtype: str = "fp32"
    vocab_size: int | None = None
    hierarchical: bool = False  # the engine's --hierarchical exchange

    def __post_init__(self) -> None:
        if not self.tokens_per_second > 0:
            raise GradzipError(f"--tokens-per-second must be positive, got {self.tokens_per_second}")
        for name in ("batch_size", "seq_len", "accumulation"):
            if getattr(self, name) < 1:
                raise GradzipError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.overlap <= 1:
            raise GradzipError(f"--overlap must be in [0, 1], got {self.overlap}")
        if not 0 <= self.backward_fraction <= 1:
            raise GradzipError(f"--backward-fraction must be in [0, 1], got {self.backward_fraction}")
        if not self.bucket_cap_mb > 0 or self.min_compress_numel < 0:
            raise GradzipError("--bucket-cap-mb must be positive and --min-compress-numel >= 0")
        if self.grad_dtype not in DTYPES:
            raise GradzipError(f"unknown gradient dtype {self.grad_dtype!r}; choose one of {', '.join(DTYPES)}")

    @property
    def tokens_per_step(self) -> int:
        """Tokens one GPU processes per optimizer step."""
        return self.batch_size * self.seq_len * self.accumulation


@dataclass
class Prediction:
    compressor: str
    exchange: str               # the scheme: allreduce, allgather, twophase, sparse
    hierarchical: bool          # the engine's hierarchical exchange (compress only between nodes)
    workers: int
    params: int
    payload_bytes: float        # per GPU per step, all rounds (the compressor's formula); outer --sync: mean
    sent_bytes: float           # per GPU per step by the flat-ring formulas (= the engine's bytes_sent)
    inter_bytes: float          # of which cross between nodes (less than sent_bytes only when hierarchical)
    compression_ratio: float    # fp32 gradient bytes / payload bytes (of one whole sync)
    collectives: float          # per step (outer --sync: mean over the period)
    compute_s: float
    backward_s: float
    compress_s: float
    comm_s: float               # total link time of the step's collectives
    exposed_comm_s: float
    step_s: float
    tokens_per_s: float         # whole cluster
    scaling_efficiency: float
    days: float | None = None
    detail: dict[str, float] = field(default_factory=dict)
    sync: str = "step"          # the --sync spec (canonical spelling)
    syncs_per_step: float = 1.0  # exchanges per step: 1 for step, P / H for the outer modes
    bytes_per_sync: float = 0.0  # payload per GPU of one exchange (outer: one fragment, mean over fragments)
    peak_sync_bytes: float = 0.0  # the largest single exchange (outer: the largest fragment)
    sync_exposed_s: float = 0.0  # per period of H steps: what the syncs add to H · compute_s (step: H = 1)
    outer_s: float = 0.0         # per step (mean): the outer step's local work (--memory-bandwidth)
    compute_utilisation: float = 1.0  # H · compute_s / period = compute_s / step_s


# ------------------------------------------------------------------------------ the model's buckets
@dataclass(frozen=True)
class BucketShape:
    shapes: tuple[tuple[int, ...], ...]
    numel: int
    compressed: bool


@functools.lru_cache(maxsize=32)
def model_buckets(model: str, vocab_size: int | None, cap_mb: float, min_compress_numel: int,
                  separate_small: bool, dtype_name: str = "fp32") -> tuple[tuple[BucketShape, ...], int]:
    """The engine's buckets for the named model (shapes only: meta tensors, nothing allocated)."""
    shapes = model_shapes(model, vocab_size)
    dtype = DTYPES[dtype_name]
    params = [(n, torch.nn.Parameter(torch.empty(s, device="meta", dtype=dtype))) for n, s in shapes.items()]
    buckets = assign_buckets(params, int(cap_mb * MiB), min_compress_numel, separate_small=separate_small)
    out = tuple(BucketShape(tuple(tuple(s) for s in b.shapes), b.numel, b.compressed) for b in buckets)
    return out, sum(math.prod(s) for s in shapes.values())


def fragment_buckets(buckets: tuple[BucketShape, ...], parts: int) -> list[tuple[BucketShape, ...]]:
    """The buckets of each of ``parts`` fragments (:func:`split_fragments`)."""
    return [tuple(buckets[i] for i in group) for group in split_fragments([b.numel for b in buckets], parts)]


def separate_small_for(comp: Compressor) -> bool:
    # As the engine: with plain `none`, small tensors ride in the ordinary buckets (no extra collectives).
    return not comp.identity


@dataclass
class ExchangeCost:
    """What exchanging a list of buckets costs: totals per GPU (payload, bytes sent and crossing
    nodes, collectives) and each bucket's timing."""

    payload: float = 0.0
    sent: float = 0.0
    inter: float = 0.0
    calls: int = 0
    compressed_numel: int = 0
    timings: list[BucketTiming] = field(default_factory=list)
    # Link seconds per scheme: "{name}_s" of every registered scheme, then "hierarchical_s".
    detail: dict[str, float] = field(default_factory=lambda: dict.fromkeys(detail_keys(), 0.0))


def exchange(comp: Compressor, buckets: tuple[BucketShape, ...], ready: list[float], work: Workload, cl: Cluster,
             codec: CodecCost) -> ExchangeCost:
    """Payload, bytes, collectives and timings of ``buckets`` (3–5 of the docstring), bucket i
    ready at ``ready[i]``."""
    dtype = DTYPES[work.grad_dtype]
    esize = torch.empty((), dtype=dtype).element_size()
    bucket_model = hierarchical_bucket if work.hierarchical else flat_bucket
    ex = ExchangeCost()
    for b, r in zip(buckets, ready):
        if b.compressed:
            ex.compressed_numel += b.numel
            ex.payload += comp.batch_payload_bytes(b.shapes, dtype)
        else:
            ex.payload += b.numel * esize
        bc = bucket_model(comp, b.shapes, b.numel, b.compressed, dtype, cl, codec, r)
        ex.timings.append(bc.timing)
        ex.sent, ex.inter, ex.calls = ex.sent + bc.sent, ex.inter + bc.inter, ex.calls + bc.calls
        ex.detail[bc.kind] += bc.link_s
    return ex


def ready_times(buckets: tuple[BucketShape, ...], work: Workload) -> tuple[float, float, list[float]]:
    """(compute, backward of the last micro-batch, each bucket's ready time) of one step. The one
    overlap rule (cluster.schedule): buckets complete in order through the last ``overlap`` fraction
    of the last micro-batch's backward, each when its gradients are done."""
    compute = work.tokens_per_step / work.tokens_per_second
    backward = work.backward_fraction * compute / work.accumulation
    total_numel = sum(b.numel for b in buckets) or 1
    ready = [compute - work.overlap * backward * (1.0 - done / total_numel)
             for done in itertools.accumulate(b.numel for b in buckets)]
    return compute, backward, ready


def exchanged_spec(spec: str, sync: str | SyncSpec | None) -> str:
    """The compressor spec whose payload ``sync`` exchanges: ``spec`` (``--compressor``), or the
    codec of a mode that sends its own (``sparseloco``: :func:`gradzip.plan.sync.mode_codec`), which
    refuses any ``--compressor`` but ``none`` (or that codec itself), as ``gradzip train`` does
    (one-line error)."""
    sync = parse_sync(sync)
    own = mode_codec(sync)
    if own is None:
        return spec
    if spec.strip().lower() not in ("none", own):
        raise GradzipError(f"--sync {sync.mode} sends its own codec ({own}): drop --compressor {spec} and set the "
                           f"codec's parameters in --sync (e.g. {sync.mode}:k=32)")
    try:
        create(own)
    except GradzipError as e:  # the codec's own message, said of --sync (as gradzip train says it)
        raise GradzipError(str(e) if str(e).startswith("--sync") else f"--sync {e}") from None
    return own


def predict(spec: str, work: Workload, cl: Cluster, codec: CodecCost | None = None,
            tokens: float | None = None, epochs: float = 1.0, sync: str | SyncSpec | None = None,
            memory_bps: float | None = None) -> Prediction:
    """The cost model of the module docstring for one compressor spec and one ``--sync`` spec
    (``memory_bps``: GPU memory bandwidth in bits/s for the outer step's local work, or None). A mode
    with a codec of its own (:func:`exchanged_spec`) sends every parameter through it; ``codec`` is
    then that codec's cost."""
    codec = codec or CodecCost()
    sync = parse_sync(sync)
    if mode_codec(sync) is not None:  # every parameter in the mode's codec (--min-compress-numel does not apply)
        spec, work = exchanged_spec(spec, sync), replace(work, min_compress_numel=0)
    comp = create(spec)
    if sync.outer:
        return _predict_outer(comp, sync, work, cl, codec, tokens, epochs, memory_bps)
    buckets, params = model_buckets(work.model, work.vocab_size, work.bucket_cap_mb, work.min_compress_numel,
                                    separate_small_for(comp), work.grad_dtype)
    n = cl.workers
    compute, backward, ready = ready_times(buckets, work)
    ex = exchange(comp, buckets, ready, work, cl, codec)
    modelled = model_step(compute, ex.timings)
    compress, comm, exposed, step = modelled.compress_s, modelled.link_s, modelled.comm_s, modelled.step_s
    tps = n * work.tokens_per_step / step
    return Prediction(
        compressor=comp.spec, exchange=comp.exchange, hierarchical=work.hierarchical, workers=n, params=params,
        payload_bytes=int(ex.payload), sent_bytes=int(round(ex.sent)), inter_bytes=int(round(ex.inter)),
        compression_ratio=params * 4 / ex.payload if ex.payload else math.inf,
        collectives=ex.calls if n > 1 else 0,
        compute_s=compute, backward_s=backward, compress_s=compress, comm_s=comm, exposed_comm_s=exposed,
        step_s=step, tokens_per_s=tps, scaling_efficiency=compute / step,
        days=None if tokens is None else tokens * epochs / tps / 86400.0,
        detail={**ex.detail, "compressed_elements": ex.compressed_numel},
        sync=str(sync), bytes_per_sync=int(ex.payload), peak_sync_bytes=int(ex.payload),
        sync_exposed_s=step - compute, compute_utilisation=compute / step,
    )


def _predict_outer(comp: Compressor, sync: SyncSpec, work: Workload, cl: Cluster, codec: CodecCost,
                   tokens: float | None, epochs: float, memory_bps: float | None) -> Prediction:
    """8. of the module docstring: H inner steps, then one sync of each of P fragments."""
    h, n = sync.every, cl.workers
    cap_mb = work.bucket_cap_mb
    if sync.fragments > 1:  # the engine's rule: buckets of at most 1/(2P) of the model
        _, params = model_buckets(work.model, work.vocab_size, cap_mb, work.min_compress_numel,
                                  separate_small_for(comp), work.grad_dtype)
        total = params * torch.empty((), dtype=DTYPES[work.grad_dtype]).element_size()
        cap_mb = fragment_cap(total, int(cap_mb * MiB), sync.fragments) / MiB
    buckets, params = model_buckets(work.model, work.vocab_size, cap_mb, work.min_compress_numel,
                                    separate_small_for(comp), work.grad_dtype)
    frags = fragment_buckets(buckets, sync.fragments)
    compute = work.tokens_per_step / work.tokens_per_second
    total = ExchangeCost()
    payloads, codec_s, link_s, exposed_link, outer_s = [], 0.0, 0.0, 0.0, 0.0
    for fb in frags:
        ex = exchange(comp, fb, [0.0] * len(fb), work, cl, codec)  # every bucket ready at once
        m = model_step(0.0, ex.timings)  # for its sums: encode/decode work, link time
        payloads.append(ex.payload)
        codec_s, link_s = codec_s + m.compress_s, link_s + m.link_s
        exposed_link += max(0.0, m.link_s - sync.delay * compute)  # hidden behind τ inner steps (overlap: below)
        if memory_bps:
            outer_s += OUTER_ACCESSES * 4 * sum(b.numel for b in fb) * 8 / memory_bps
        total.sent, total.inter, total.calls = total.sent + ex.sent, total.inter + ex.inter, total.calls + ex.calls
        total.compressed_numel += ex.compressed_numel
        for k, v in ex.detail.items():
            total.detail[k] += v
    if sync.overlap:  # every exchange travels during the next H inner steps, on the one link
        exposed_link = max(0.0, link_s - h * compute)
    exposed = codec_s + exposed_link + outer_s
    period = h * compute + exposed
    step = period / h
    tps = n * work.tokens_per_step / step
    payload = sum(payloads)
    return Prediction(
        compressor=comp.spec, exchange=comp.exchange, hierarchical=work.hierarchical, workers=n, params=params,
        payload_bytes=payload / h, sent_bytes=total.sent / h, inter_bytes=total.inter / h,
        compression_ratio=params * 4 / payload if payload else math.inf,
        collectives=total.calls / h if n > 1 else 0,
        compute_s=compute, backward_s=work.backward_fraction * compute / work.accumulation,
        compress_s=codec_s / h, comm_s=link_s / h, exposed_comm_s=exposed_link / h, step_s=step,
        tokens_per_s=tps, scaling_efficiency=compute / step,
        days=None if tokens is None else tokens * epochs / tps / 86400.0,
        detail={**{k: v / h for k, v in total.detail.items()}, "compressed_elements": total.compressed_numel},
        sync=str(sync), syncs_per_step=len(frags) / h, bytes_per_sync=payload / len(frags),
        peak_sync_bytes=max(payloads), sync_exposed_s=exposed, outer_s=outer_s / h,
        compute_utilisation=h * compute / period,
    )
