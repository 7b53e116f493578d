"""The ``auto`` policy at run time: measure, plan per bucket, act, watch, re-plan.

:class:`AutoEngine` is a :class:`gradzip.engine.choice.ChoiceEngine` (a candidate per bucket, error
memory carried across switches) with the loop that steers it:

1. **Warm-up**: the first ``warmup`` steps go uncompressed, every bucket on ``none``.
2. **Measure** after the first step that has a compute time: the link (sim: the modelled one;
   real backends: allreduces of 64 KiB, 1 MiB and 8 MiB, their α–β fit) and each candidate's
   encode + decode time per element on buffers of the actual buckets' sizes. Real backends take
   the mean of each figure over the ranks (one small allreduce), so every rank plans alike.
3. **Plan** (:func:`gradzip.cluster.auto.plan_buckets`): per bucket, the candidate that minimises
   the step predicted by the cost model, overlap included, within the ``floor``; assign it.
4. **Watch**: every step compares the measured exposed communication with the plan's prediction
   (the ranks' mean gap, one 8-byte allreduce, so that all ranks decide alike: a re-plan is
   collective); off by more than ``tolerance`` of the predicted step for ``patience`` steps in a
   row, or every ``replan_every`` steps, the policy measures and plans again.

Every plan is a line of ``policy.jsonl`` (``step``, ``reason``, the probe's ``latency_s``,
``bandwidth_bps`` and ``probe_bytes``, the traffic it cost, which the steps' ``bytes_sent`` leave
out; ``predicted_step_s``, ``predicted_comm_s``, the measured ``comm_s`` of the step that triggered
it, each candidate alone, and per bucket its ``numel`` and ``candidate``), written by rank 0. When
no candidate is predicted faster than ``none``, the line says so (``none_is_best``) and so does
``summary()``. The plan and the counters are checkpoint state: a resumed run carries on with the
same assignment, and its ``policy.jsonl`` loses the plans made after the checkpoint.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from gradzip.cluster.auto import AutoPlan, plan_buckets
from gradzip.cluster.network import Cluster, CodecCost
from gradzip.cluster.simulate import BucketShape, Workload
from gradzip.comm.base import Communicator
from gradzip.comm.sim import SimWorld
from gradzip.compress.base import unflatten
from gradzip.compress.registry import create
from gradzip.engine.choice import ChoiceEngine
from gradzip.engine.config import EngineConfig
from gradzip.engine.stats import StepStats
from gradzip.engine.synchronizer import OptimizerStep
from gradzip.errors import GradzipError
from gradzip.io import atomic_write_text, read_jsonl
from gradzip.plan.auto import AutoSpec, parse_auto

PROBE_BYTES = (64 << 10, 1 << 20, 8 << 20)


class AutoEngine(ChoiceEngine):
    """The engine under the ``auto`` policy (module docstring). ``log``: where rank 0 appends
    ``policy.jsonl`` (None: not written)."""

    def __init__(self, model: torch.nn.Module, spec: str, comm: Communicator | SimWorld,
                 config: EngineConfig | None = None, log: str | Path | None = None) -> None:
        self.auto: AutoSpec = parse_auto(spec)
        candidates = tuple(dict.fromkeys(("none", *self.auto.allowed)))
        super().__init__(model, candidates, comm, config)
        self.spec = self.auto.spec
        self.names = {create(c).spec: c for c in candidates}  # canonical spec -> the user's spelling
        self._world = comm if isinstance(comm, SimWorld) else None
        self.log = Path(log) if log is not None and (self.sim or self.comm.rank == 0) else None
        self.steps = 0           # steps committed
        self.planned_at = -1     # step of the last plan (-1: none yet)
        self.drift = 0           # steps in a row off the prediction
        self.prediction: dict[str, float] = {}
        self.plans: list[dict[str, Any]] = []
        self._last_stats: StepStats | None = None  # the step commit() decides on

    # ------------------------------------------------------------------ measure
    def probe_link(self) -> tuple[float, float]:
        """(latency s, bandwidth bits/s) of the link: sim's model, or an α–β fit of timed allreduces."""
        if self._world is not None:
            return float(self._world.inter.latency_s), float(self._world.inter.bandwidth_bps)
        comm, n = self.comm, self.world_size
        if n <= 1:
            return 0.0, float("inf")
        pts = []
        for nbytes in PROBE_BYTES:
            buf = torch.zeros(nbytes // 4, device=self.buckets[0].device)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                comm.allreduce(buf, "sum")
                best = min(best, time.perf_counter() - t0)
            pts.append((2 * (n - 1) / n * nbytes * 8, best))  # ring allreduce: bits each rank sends, time
        (x0, t0), (x1, t1) = pts[0], pts[-1]
        per_bit = max((t1 - t0) / max(x1 - x0, 1.0), 1e-15)
        alpha = max(0.0, (t0 - per_bit * x0) / (2 * (n - 1)))
        return alpha, 1.0 / per_bit

    def time_codecs(self) -> dict[str, CodecCost]:
        """Each candidate's encode + decode seconds per element, on buffers of the compressed buckets' sizes."""
        out = {"none": CodecCost(0.0, 0.0, "none")}
        sizes = [b for b in self.buckets if b.compressed]
        for spec in self.candidates:
            if spec == "none" or not sizes:
                continue
            c, total, elems = create(spec), 0.0, 0
            for b in sizes:
                x = torch.randn(b.numel, device=b.device)
                tensors = unflatten(x, b.shapes) if c.per_tensor else [x]
                best = float("inf")
                for _ in range(2):
                    t0 = self._now()
                    payload, ctx = c.compress_batch(tensors, "probe")
                    for _ in range(c.rounds - 1):  # one worker's rounds: the reduced payload is its own
                        payload, ctx = c.next_round_batch(payload, ctx)
                    c.decompress_batch(payload, ctx)
                    best = min(best, self._now() - t0)
                c.forget("probe")
                total, elems = total + best, elems + b.numel
            out[spec] = CodecCost(total / max(elems, 1), 0.0, "measured on this run's buckets")
        return out

    def _agree(self, values: list[float]) -> list[float]:
        """The mean of each value over the ranks (sim: itself): every rank plans from the same figures."""
        if self.sim or self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.buckets[0].device)
        self.comm.allreduce(t, "mean")
        return t.tolist()

    # ------------------------------------------------------------------ plan and act
    def replan(self, stats: StepStats, reason: str) -> AutoPlan:
        sent0 = sum(w.comm.stats.bytes_sent for w in self._workers)
        latency, bandwidth = self.probe_link()
        codecs = self.time_codecs()
        specs = [s for s in self.candidates if s != "none"]
        agreed = self._agree([latency, 1.0 / bandwidth, stats.compute_s, *(codecs[s].encode_s for s in specs)])
        probe_bytes = sum(w.comm.stats.bytes_sent for w in self._workers) - sent0
        for w in self._workers:  # the probe's traffic is the policy's, reported below, not the next step's
            w.snap = w.comm.stats.snapshot()
        latency, bandwidth, compute = agreed[0], 1.0 / max(agreed[1], 1e-18), max(agreed[2], 1e-9)
        codecs.update({s: CodecCost(v, 0.0, "measured") for s, v in zip(specs, agreed[3:])})
        n = self.world_size if not self.sim else len(self._workers)
        cl = Cluster(n, 1, bandwidth, bandwidth, latency, latency, "ring")
        shapes = tuple(BucketShape(tuple(tuple(s) for s in b.shapes), b.numel, b.compressed) for b in self.buckets)
        work = Workload("auto", tokens_per_second=1.0 / compute, batch_size=1, seq_len=1, overlap=1.0,
                        grad_dtype=_dtype_name(self.buckets[0].dtype))
        p = plan_buckets(self.auto, shapes, work, cl, codecs)
        for i, spec in enumerate(p.choice):
            self.assign(i, spec)
        self.planned_at, self.drift = self.steps, 0
        self.prediction = {"step_s": p.step_s, "comm_s": p.comm_s}
        rec = {"step": self.steps, "reason": reason, "latency_s": latency, "bandwidth_bps": bandwidth,
               "probe_bytes": int(probe_bytes),
               "compute_s": compute, "predicted_step_s": p.step_s, "predicted_comm_s": p.comm_s,
               "measured_comm_s": stats.comm_s, "fixed_step_s": p.fixed, "none_is_best": p.none_is_best,
               "buckets": [{"bucket": i, "numel": n_, "candidate": c} for i, (c, n_) in enumerate(zip(p.choice,
                                                                                                     p.numels))]}
        self.plans.append({k: rec[k] for k in ("step", "reason", "none_is_best")})
        if self.log is not None:
            with open(self.log, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
        return p

    def commit(self, nonfinite: int, stepper: OptimizerStep) -> float:
        """The engine's commit, then the policy's turn (between steps, on every rank alike)."""
        norm = super().commit(nonfinite, stepper)
        self.steps += 1
        stats = self._last_stats
        if self.steps < self.auto.warmup or stats is None:
            return norm
        if self.planned_at < 0:
            self.replan(stats, "first plan" if not self.auto.warmup else f"after {self.auto.warmup} warm-up steps")
            return norm
        # The ranks' mean gap, so that every rank takes the same decision (a re-plan is collective).
        gap = self._agree([abs(stats.comm_s - self.prediction["comm_s"])])[0]
        for w in self._workers:  # that tiny allreduce is the policy's, not the next step's traffic
            w.snap = w.comm.stats.snapshot()
        self.drift = self.drift + 1 if gap > self.auto.tolerance * self.prediction["step_s"] else 0
        if self.drift >= self.auto.patience:
            self.replan(stats, f"measured communication off the prediction for {self.drift} steps")
        elif self.auto.replan_every and self.steps - self.planned_at >= self.auto.replan_every:
            self.replan(stats, f"every {self.auto.replan_every} steps")
        return norm

    def synchronize(self) -> StepStats:
        self._last_stats = stats = super().synchronize()
        return stats

    @property
    def exchange(self) -> str:
        return "per bucket"

    def summary(self) -> dict[str, Any]:
        """What ``summary.json`` reports of the policy."""
        counts: dict[str, int] = {}
        for c in self.assigned:
            counts[self.names.get(c, c)] = counts.get(self.names.get(c, c), 0) + 1
        none_best = bool(self.plans and self.plans[-1]["none_is_best"])
        out: dict[str, Any] = {"auto_plans": len(self.plans), "auto_choice": counts, "auto_none_is_best": none_best}
        if none_best:
            out["auto_note"] = "no candidate was predicted faster than none on this link: buckets went uncompressed"
        return out

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["auto"] = {"steps": self.steps, "planned_at": self.planned_at, "drift": self.drift,
                      "prediction": dict(self.prediction), "plans": list(self.plans)}
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        a = state.get("auto")
        if a is None:
            raise GradzipError("engine state has no auto policy state; resume with the compressor it was written with")
        self.steps, self.planned_at, self.drift = int(a["steps"]), int(a["planned_at"]), int(a["drift"])
        self.prediction, self.plans = dict(a["prediction"]), list(a["plans"])
        if self.log is not None and self.log.is_file():  # a resumed run: the plans after its checkpoint go
            keep = [r for r in read_jsonl(self.log) if isinstance(r, dict) and r.get("step", 0) <= self.steps]
            atomic_write_text(self.log, "".join(json.dumps(r) + "\n" for r in keep))


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")
