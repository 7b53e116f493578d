"""What the ``auto`` policy measures and how it turns measurements into a plan, shared by the
engine's policy (:mod:`gradzip.engine.auto`) and the DDP hook's (:mod:`gradzip.engine.ddp_auto`).

- :func:`probe_link`: the link's latency and bandwidth, an α–β fit of timed ring allreduces
  (the best of 3 each) of 64 KiB and 1 MiB, and 8 MiB when 1 MiB takes under 20 ms;
- :func:`time_codecs`: each candidate's encode + decode seconds per element, on buffers of the
  actual compressed buckets' sizes (the best of 2 rounds);
- :func:`agree`: the mean of each figure over the ranks, so that every rank plans alike;
- :func:`make_plan`: the per-bucket plan (:func:`gradzip.cluster.auto.plan_buckets`) for a flat
  ring of ``n`` ranks on the measured link;
- :class:`PolicyLog`: ``policy.jsonl``, one line per plan, cut back on resume; and
  :func:`policy_summary`, the ``auto_*`` fields of ``summary.json``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gradzip.cluster.auto import AutoPlan, plan_buckets
from gradzip.cluster.network import Cluster, CodecCost
from gradzip.cluster.simulate import BucketShape, Workload
from gradzip.compress.base import unflatten
from gradzip.compress.registry import create
from gradzip.errors import CommError
from gradzip.io import atomic_write_text, read_jsonl
from gradzip.plan.auto import AutoSpec

PROBE_BYTES = (64 << 10, 1 << 20, 8 << 20)
PROBE_ENOUGH_S = 0.02  # a transfer this long measures the bandwidth well enough


def probe_link(comm: Any, n: int, device: torch.device | str = "cpu",
               group: str = "all ranks") -> tuple[float, float]:
    """(latency s, bandwidth bits/s) from timed allreduces on ``comm`` (``n`` ranks; collective).
    A collective that fails or times out is re-raised, as the same error, naming ``group`` before
    the communicator's own message (which names the rank).

    Sizes go up from 64 KiB and stop at the first (after two) whose transfer takes
    :data:`PROBE_ENOUGH_S`: a longer one would tell no more and, on a slow link, costs seconds of
    link time (8 MiB take 1.3 s at 100 Mbit/s). Every rank stops at the same size: the decision
    is on the ranks' mean time (one 8-byte allreduce per size)."""
    if n <= 1:
        return 0.0, float("inf")
    try:
        return _probe(comm, n, device)
    except CommError as e:
        raise type(e)(f"auto's link probe over {group}: {e}") from e


def _probe(comm: Any, n: int, device: torch.device | str) -> tuple[float, float]:
    pts = []
    for nbytes in PROBE_BYTES:
        buf = torch.zeros(nbytes // 4, device=device)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            comm.allreduce(buf, "sum")
            best = min(best, time.perf_counter() - t0)
        best = agree(comm, n, [best], device)[0]
        pts.append((2 * (n - 1) / n * nbytes * 8, best))  # ring allreduce: bits each rank sends, time
        if len(pts) >= 2 and best >= PROBE_ENOUGH_S:
            break
    (x0, t0), (x1, t1) = pts[0], pts[-1]
    per_bit = max((t1 - t0) / max(x1 - x0, 1.0), 1e-15)
    alpha = max(0.0, (t0 - per_bit * x0) / (2 * (n - 1)))
    return alpha, 1.0 / per_bit


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


def plan_record(step: int, reason: str, latency: float, bandwidth: float, probe_bytes: int, compute: float,
                p: AutoPlan, measured_comm: float, opt_s: float = 0.0) -> dict[str, Any]:
    """One line of ``policy.jsonl`` (the fields :mod:`gradzip.engine.auto` documents). ``opt_s``:
    the optimizer step's measured time, which the plan leaves out (the same for every candidate)
    and the predicted step times include, so that they compare with ``metrics.jsonl``'s ``step_s``."""
    return {"step": step, "reason": reason, "latency_s": latency, "bandwidth_bps": bandwidth,
            "probe_bytes": int(probe_bytes), "compute_s": compute, "opt_s": opt_s, "predicted_step_s": p.step_s + opt_s,
            "predicted_comm_s": p.comm_s, "measured_comm_s": measured_comm,
            "fixed_step_s": {c: t + opt_s for c, t in p.fixed.items()},
            "none_is_best": p.none_is_best,
            "buckets": [{"bucket": i, "numel": k, "candidate": c} for i, (c, k) in enumerate(zip(p.choice, p.numels))]}


def policy_summary(chosen: list[str], plans: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``auto_*`` fields of ``summary.json``: plans made, buckets per candidate (``chosen``:
    each bucket's, in the user's spelling), and whether the last plan found ``none`` best."""
    counts: dict[str, int] = {}
    for c in chosen:
        counts[c] = counts.get(c, 0) + 1
    none_best = bool(plans and plans[-1]["none_is_best"])
    out: dict[str, Any] = {"auto_plans": len(plans), "auto_choice": counts, "auto_none_is_best": none_best}
    if none_best:
        out["auto_note"] = "no candidate was predicted faster than none on this link: buckets went uncompressed"
    return out


class PolicyLog:
    """``policy.jsonl``: appended one plan per line; ``path=None`` writes nothing (ranks other than 0)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else None

    def append(self, rec: dict[str, Any]) -> None:
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")

    def cut_after(self, step: int) -> None:
        """A resumed run: the plans made after its checkpoint go (the steps will be run again)."""
        if self.path is not None and self.path.is_file():
            keep = [r for r in read_jsonl(self.path) if isinstance(r, dict) and r.get("step", 0) <= step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in keep))
