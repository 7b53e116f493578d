"""The ``auto`` policy at run time: measure, plan per bucket, act, watch, re-plan.

:class:`AutoEngine` is a :class:`gradzip.engine.choice.ChoiceEngine` (a candidate per bucket, error
memory carried across switches) with the loop that steers it:

1. **Warm-up**: the first ``warmup`` steps go uncompressed, every bucket on ``none``.
2. **Measure** after the first step that has a compute time: the link (sim: the modelled one;
   real backends: allreduces of 64 KiB, 1 MiB and, on a fast link, 8 MiB, their α–β fit) and
   each candidate's encode + decode time per element on buffers of the actual buckets' sizes. Real backends take
   the mean of each figure over the ranks (one small allreduce), so every rank plans alike.
3. **Plan** (:func:`gradzip.cluster.auto.plan_buckets`): per bucket, the candidate that minimises
   the step predicted by the cost model, overlap included, within the ``floor``; assign it.
4. **Watch**: every step compares the measured exposed communication with the plan's prediction
   (the ranks' mean gap, one 8-byte allreduce, so that all ranks decide alike: a re-plan is
   collective); off by more than ``tolerance`` of the predicted step for ``patience`` steps in a
   row, or every ``replan_every`` steps, the policy measures and plans again.

Every plan is a line of ``policy.jsonl`` (``step``, ``reason``, the probe's ``latency_s``,
``bandwidth_bps`` and ``probe_bytes``, the traffic it cost, which the steps' ``bytes_sent`` leave
out; ``opt_s``, the optimizer step's time, which ``predicted_step_s`` (and each candidate's
``fixed_step_s``) adds to the plan's step so that it compares with ``metrics.jsonl``'s ``step_s``;
``predicted_comm_s``, the measured ``comm_s`` of the step that triggered
it, each candidate alone, and per bucket its ``numel`` and ``candidate``), written by rank 0. When
no candidate is predicted faster than ``none``, the line says so (``none_is_best``) and so does
``summary()``. The plan and the counters are checkpoint state: a resumed run carries on with the
same assignment, and its ``policy.jsonl`` loses the plans made after the checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from gradzip.cluster.auto import AutoPlan
from gradzip.cluster.network import CodecCost
from gradzip.cluster.simulate import BucketShape
from gradzip.comm.base import Communicator
from gradzip.comm.sim import SimWorld
from gradzip.compress.registry import create
from gradzip.engine.auto_measure import (
    PolicyLog,
    agree,
    dtype_name,
    make_plan,
    plan_record,
    policy_summary,
    probe_link,
    time_codecs,
)
from gradzip.engine.choice import ChoiceEngine
from gradzip.engine.config import EngineConfig
from gradzip.engine.stats import StepStats
from gradzip.engine.synchronizer import OptimizerStep
from gradzip.errors import GradzipError
from gradzip.plan.auto import AutoSpec, parse_auto


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
        self.log = PolicyLog(log if self.sim or self.comm.rank == 0 else None)
        self.steps = 0           # steps committed
        self.planned_at = -1     # step of the last plan (-1: none yet)
        self.drift = 0           # steps in a row off the prediction
        self.prediction: dict[str, float] = {}
        self.plans: list[dict[str, Any]] = []
        self._last_stats: StepStats | None = None  # the step commit() decides on
        self._opt_s = 0.0  # the last optimizer step's time (real backends)

    # ------------------------------------------------------------------ measure
    def probe_link(self) -> tuple[float, float]:
        """(latency s, bandwidth bits/s) of the link (between nodes, under the hierarchical
        exchange): sim's model, or an α–β fit of timed allreduces."""
        if self._world is not None:
            return float(self._world.inter.latency_s), float(self._world.inter.bandwidth_bps)
        if not self.config.hierarchical:
            return probe_link(self.comm, self.world_size, self.buckets[0].device)
        # Between nodes: the node leaders' group alone (the model shares the NIC among a node's
        # groups itself); the other ranks wait, then every rank takes the leaders' mean.
        topo = self._workers[0].scheme.topo
        device = self.buckets[0].device
        mine = (probe_link(topo.cross, topo.cross.world_size, device, "the node leaders (between nodes)")
                if topo.local_rank == 0 else (0.0, 0.0))
        t = torch.tensor([mine[0], 1.0 / mine[1] if mine[1] else 0.0], dtype=torch.float64, device=device)
        self.comm.allreduce(t, "sum")
        leaders = max(self.world_size // topo.ranks_per_node, 1)
        return t[0].item() / leaders, leaders / max(t[1].item(), 1e-18)

    def probe_intra(self) -> tuple[int, float, float] | None:
        """Under the hierarchical exchange: (ranks per node, latency, bandwidth) inside a node, each
        node's own group probed side by side; None otherwise."""
        if not self.config.hierarchical:
            return None
        if self._world is not None:
            w = self._world
            return w.ranks_per_node, float(w.intra.latency_s), float(w.intra.bandwidth_bps)
        topo = self._workers[0].scheme.topo
        return (topo.ranks_per_node, *probe_link(topo.node, topo.ranks_per_node, self.buckets[0].device,
                                                 f"the ranks of rank {self.comm.rank}'s node (inside it)"))

    def time_codecs(self) -> dict[str, CodecCost]:
        """Each candidate's encode + decode seconds per element, on buffers of the compressed buckets' sizes."""
        sizes = [(b.numel, b.shapes) for b in self.buckets if b.compressed]
        device = self.buckets[0].device if self.buckets else "cpu"
        return time_codecs(self.candidates, sizes, device, self._now)

    def _agree(self, values: list[float]) -> list[float]:
        """The mean of each value over the ranks (sim: itself): every rank plans from the same figures."""
        if self.sim:
            return values
        return agree(self.comm, self.world_size, values, self.buckets[0].device)

    # ------------------------------------------------------------------ plan and act
    def replan(self, stats: StepStats, reason: str) -> AutoPlan:
        sent0 = sum(w.comm.stats.bytes_sent for w in self._workers)
        latency, bandwidth = self.probe_link()
        intra = self.probe_intra()
        codecs = self.time_codecs()
        specs = [s for s in self.candidates if s != "none"]
        agreed = self._agree([latency, 1.0 / bandwidth, stats.compute_s, self._opt_s,
                              *(codecs[s].encode_s for s in specs), *(intra[1:] if intra else ())])
        if intra is not None:  # every rank plans with the mean over the nodes
            intra, agreed = (intra[0], agreed[-2], agreed[-1]), agreed[:-2]
        probe_bytes = sum(w.comm.stats.bytes_sent for w in self._workers) - sent0
        for w in self._workers:  # the probe's traffic is the policy's, reported below, not the next step's
            w.snap = w.comm.stats.snapshot()
        latency, bandwidth, compute = agreed[0], 1.0 / max(agreed[1], 1e-18), max(agreed[2], 1e-9)
        codecs.update({s: CodecCost(v, 0.0, "measured") for s, v in zip(specs, agreed[4:])})
        n = self.world_size if not self.sim else len(self._workers)
        shapes = tuple(BucketShape(tuple(tuple(s) for s in b.shapes), b.numel, b.compressed) for b in self.buckets)
        p = make_plan(self.auto, shapes, n, latency, bandwidth, compute, codecs, dtype_name(self.buckets[0].dtype),
                      intra)
        for i, spec in enumerate(p.choice):
            self.assign(i, spec)
        self.planned_at, self.drift = self.steps, 0
        self.prediction = {"step_s": p.step_s, "comm_s": p.comm_s}
        self.plans.append({"step": self.steps, "reason": reason, "none_is_best": p.none_is_best})
        rec = plan_record(self.steps, reason, latency, bandwidth, probe_bytes, compute, p, stats.comm_s, agreed[3])
        if intra is not None:
            rec.update(ranks_per_node=intra[0], intra_latency_s=intra[1], intra_bandwidth_bps=intra[2])
        self.log.append(rec)
        return p

    def commit(self, nonfinite: int, stepper: OptimizerStep) -> float:
        """The engine's commit, then the policy's turn (between steps, on every rank alike)."""
        t0 = time.perf_counter()
        norm = super().commit(nonfinite, stepper)
        if not self.sim:  # the optimizer step, which metrics' step_s counts (sim's modelled step does not)
            self._opt_s = time.perf_counter() - t0
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
        return policy_summary([self.names.get(c, c) for c in self.assigned], self.plans)

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
        self.log.cut_after(self.steps)  # a resumed run: the plans after its checkpoint go

