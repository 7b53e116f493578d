"""What the ``auto`` policy measures and how it turns measurements into a plan, shared by the
engine's policy (:mod:`gradzip.engine.auto`) and the DDP hook's (:mod:`gradzip.engine.ddp_auto`).

- :func:`probe_link`: the link's latency and bandwidth, an α–β fit of timed ring allreduces
  (the best of 3 each) of 64 KiB and 1 MiB, and 8 MiB when 1 MiB takes under 20 ms; and the
  host's timing noise, the spread of the 3 repeats of the largest size (:class:`LinkProbe`);
- :func:`modelled_probe_bytes`: the bytes that probe sends on a given link (``sim`` counts them);
- :func:`time_codecs`: each candidate's encode + decode seconds per element, on buffers of the
  actual compressed buckets' sizes (the best of 2 rounds);
- :func:`agree`: the mean of each figure over the ranks, so that every rank plans alike;
- :func:`make_plan`: the per-bucket plan (:func:`gradzip.cluster.auto.plan_buckets`) for a flat
  ring of ``n`` ranks on the measured link.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradzip.cluster.auto import AutoPlan, plan_buckets
from gradzip.cluster.network import Cluster, CodecCost
from gradzip.cluster.simulate import BucketShape, Workload
from gradzip.comm import cost
from gradzip.compress.base import unflatten
from gradzip.compress.registry import create
from gradzip.errors import CommError
from gradzip.plan.auto import AutoSpec

PROBE_BYTES = (64 << 10, 1 << 20, 8 << 20)
PROBE_REPEATS = 3  # timed allreduces per size: the best is the link's, their spread the host's noise
PROBE_ENOUGH_S = 0.02  # a transfer this long measures the bandwidth well enough


@dataclass(frozen=True)
class LinkProbe:
    """What :func:`probe_link` measured. ``noise``: the relative spread (slowest − fastest) /
    fastest of the repeated allreduces of the largest size probed, this rank's: how much the same
    transfer's time varies on this host (0 on a quiet one and on ``sim``)."""

    latency_s: float
    bandwidth_bps: float
    noise: float = 0.0


def probe_link(comm: Any, n: int, device: torch.device | str = "cpu",
               group: str = "all ranks") -> LinkProbe:
    """The link's latency (s) and bandwidth (bits/s) from timed allreduces on ``comm`` (``n``
    ranks; collective), and the host's noise (:class:`LinkProbe`). A collective that fails or
    times out is re-raised, as the same error, naming ``group`` before the communicator's own
    message (which names the rank).

    Sizes go up from 64 KiB and stop at the first (after two) whose transfer takes
    :data:`PROBE_ENOUGH_S`: a longer one would tell no more and, on a slow link, costs seconds of
    link time (8 MiB take 1.3 s at 100 Mbit/s). Every rank stops at the same size: the decision
    is on the ranks' mean time (one 8-byte allreduce per size)."""
    if n <= 1:
        return LinkProbe(0.0, float("inf"))
    try:
        return _probe(comm, n, device)
    except CommError as e:
        raise type(e)(f"auto's link probe over {group}: {e}") from e


def _probe(comm: Any, n: int, device: torch.device | str) -> LinkProbe:
    pts, noise = [], 0.0
    for nbytes in PROBE_BYTES:
        buf = torch.zeros(nbytes // 4, device=device)
        times = []
        for _ in range(PROBE_REPEATS):
            t0 = time.perf_counter()
            comm.allreduce(buf, "sum")
            times.append(time.perf_counter() - t0)
        best = min(times)
        noise = (max(times) - best) / max(best, 1e-12)
        best = agree(comm, n, [best], device)[0]
        pts.append((2 * (n - 1) / n * nbytes * 8, best))  # ring allreduce: bits each rank sends, time
        if _enough(len(pts), best):
            break
    (x0, t0), (x1, t1) = pts[0], pts[-1]
    per_bit = max((t1 - t0) / max(x1 - x0, 1.0), 1e-15)
    alpha = max(0.0, (t0 - per_bit * x0) / (2 * (n - 1)))
    return LinkProbe(alpha, 1.0 / per_bit, noise)


def _enough(sizes: int, best_s: float) -> bool:
    """The probe's stopping rule: two sizes at least, and the last one took :data:`PROBE_ENOUGH_S`."""
    return sizes >= 2 and best_s >= PROBE_ENOUGH_S


def modelled_probe_bytes(n: int, latency_s: float, bandwidth_bps: float) -> int:
    """Bytes one of ``n`` ranks sends in :func:`probe_link` on a link of this latency and
    bandwidth: the same sizes (the stopping rule on the modelled α–β time of each), each
    :data:`PROBE_REPEATS` ring allreduces of it and one 8-byte agreement. ``sim`` takes its link
    from the model and counts these bytes, so that its runs report what a real probe would cost."""
    if n <= 1:
        return 0
    link, total = cost.Link(bandwidth_bps, latency_s), 0
    for i, nbytes in enumerate(PROBE_BYTES):
        total += PROBE_REPEATS * cost.allreduce_bytes(nbytes, n) + cost.allreduce_bytes(8, n)
        if _enough(i + 1, cost.allreduce_time(nbytes, n, link)):
            break
    return total


def time_codecs(candidates: Sequence[str], buckets: Sequence[tuple[int, Sequence[torch.Size]]],
                device: torch.device | str = "cpu",
                now: Callable[[], float] = time.perf_counter) -> dict[str, CodecCost]:
    """Each candidate's encode + decode seconds per element on buffers of ``buckets``' sizes
    (``(numel, shapes)`` of each compressed bucket). ``none`` costs nothing."""
    out = {"none": CodecCost(0.0, 0.0, "none")}
    for spec in candidates:
        if spec == "none":
            continue
        if not buckets:  # nothing to compress (every tensor small): nothing to time
            out[spec] = CodecCost(0.0, 0.0, "no compressed bucket")
            continue
        c, total, elems = create(spec), 0.0, 0
        for numel, shapes in buckets:
            x = torch.randn(numel, device=device)
            tensors = unflatten(x, list(shapes)) if c.per_tensor else [x]
            best = float("inf")
            for _ in range(2):
                t0 = now()
                payload, ctx = c.compress_batch(tensors, "probe")
                for _ in range(c.rounds - 1):  # one worker's rounds: the reduced payload is its own
                    payload, ctx = c.next_round_batch(payload, ctx)
                c.decompress_batch(payload, ctx)
                best = min(best, now() - t0)
            c.forget("probe")
            total, elems = total + best, elems + numel
        out[spec] = CodecCost(total / max(elems, 1), 0.0, "measured on this run's buckets")
    return out


def agree(comm: Any, n: int, values: list[float], device: torch.device | str = "cpu") -> list[float]:
    """The mean of each value over the ranks (one small allreduce; alone: the values)."""
    if comm is None or n <= 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    comm.allreduce(t, "mean")
    return t.tolist()


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")


def make_plan(auto: AutoSpec, shapes: tuple[BucketShape, ...], n: int, latency: float, bandwidth: float,
              compute: float, codecs: dict[str, CodecCost], grad_dtype: str = "fp32",
              intra: tuple[int, float, float] | None = None) -> AutoPlan:
    """The plan for ``shapes`` (in the order backward makes them ready) on a flat ring of ``n``
    ranks with the measured link; compute from the measured step, overlap with backward as modelled.
    ``intra``: the hierarchical exchange's (ranks per node, latency, bandwidth inside a node);
    ``latency`` and ``bandwidth`` are then the link between nodes."""
    if intra is None:
        cl = Cluster(n, 1, bandwidth, bandwidth, latency, latency, "ring")
    else:
        g, intra_latency, intra_bandwidth = intra
        cl = Cluster(max(n // g, 1), g, bandwidth, intra_bandwidth, latency, intra_latency, "ring")
    work = Workload("auto", tokens_per_second=1.0 / max(compute, 1e-9), batch_size=1, seq_len=1, overlap=1.0,
                    grad_dtype=grad_dtype, hierarchical=intra is not None)
    return plan_buckets(auto, shapes, work, cl, codecs)


