"""The ``auto`` policy at run time: measure, plan per bucket, act, watch, re-plan.

:class:`AutoEngine` holds the actuator, a :class:`gradzip.engine.choice.ChoiceEngine` (a candidate
per bucket, error memory carried across switches), and the policy that steers it
(:mod:`gradzip.auto`):

1. **Warm-up**: the first ``warmup`` steps go uncompressed, every bucket on ``none``.
2. **Measure** after the first step that has a compute time: the link (sim: the modelled one;
   real backends: allreduces of 64 KiB, 1 MiB and, on a fast link, 8 MiB, their α–β fit, and the
   spread of their repeats: the host's noise) and each candidate's encode + decode time per
   element on buffers of the actual buckets' sizes. Real backends take the mean of each figure
   over the ranks (one small allreduce), so every rank plans alike.
3. **Plan** (:func:`gradzip.cluster.auto.plan_buckets`): per bucket, the candidate that minimises
   the step predicted by the cost model, overlap included, within the ``floor``; assign it.
4. **Watch** (:class:`gradzip.auto.watch.PolicyWatch`, the rule the DDP hook shares): every step
   compares the measured exposed communication with the plan's prediction (the ranks' mean gap,
   one 8-byte allreduce, so that all ranks decide alike: a re-plan is collective); off by more
   than ``tolerance`` of the predicted step and more than the host's noise, for ``patience``
   steps in a row, the policy probes the link again and re-plans with the codec timings it has;
   every ``replan_every`` steps it measures everything and re-plans.

The policy's own traffic (probes, agreements) is a part of the step it follows: :meth:`commit`
adds it to that step's :class:`StepStats` (``bytes_sent``, ``bytes_recv``, and apart in
``probe_bytes``), which the training loop records after the commit, so the run's bytes and its
compression figure include it. ``sim`` takes the link from its model and counts the bytes a real
probe and agreements would send (:func:`gradzip.auto.measure.modelled_probe_bytes`).

Every plan is a line of ``policy.jsonl`` (``step``, ``reason``, the probe's ``latency_s``,
``bandwidth_bps``, ``noise`` and ``probe_bytes``, the traffic it cost; ``codecs_reused``;
``opt_s``, the optimizer step's time, which ``predicted_step_s`` (and each candidate's
``fixed_step_s``) adds to the plan's step so that it compares with ``metrics.jsonl``'s ``step_s``;
``predicted_comm_s``, the measured ``comm_s`` of the step that triggered it, each candidate
alone, and per bucket its ``numel`` and ``candidate``), written by rank 0. When no candidate is
predicted faster than ``none``, the line says so (``none_is_best``) and so does ``summary()``.
The plan and the counters are checkpoint state: a resumed run carries on with the same
assignment, and its ``policy.jsonl`` loses the plans made after the checkpoint.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gradzip.auto.measure import LinkProbe, agree, dtype_name, make_plan, modelled_probe_bytes, probe_link, time_codecs
from gradzip.auto.record import PolicyLog, plan_record, policy_summary
from gradzip.auto.watch import PolicyWatch, Replan
from gradzip.cluster.auto import AutoPlan
from gradzip.cluster.network import CodecCost
from gradzip.cluster.simulate import BucketShape
from gradzip.comm import cost
from gradzip.comm.base import Communicator
from gradzip.comm.sim import SimWorld
from gradzip.compress.registry import create
from gradzip.engine.choice import ChoiceEngine
from gradzip.engine.config import EngineConfig
from gradzip.engine.stats import StepStats
from gradzip.engine.synchronizer import OptimizerStep
from gradzip.errors import GradzipError
from gradzip.plan.auto import AutoSpec, parse_auto


class AutoEngine:
    """The engine under the ``auto`` policy (module docstring): a :class:`ChoiceEngine`
    (``self.engine``) and its policy. ``log``: where rank 0 appends ``policy.jsonl`` (None: not
    written)."""

    def __init__(self, model: torch.nn.Module, spec: str, comm: Communicator | SimWorld,
                 config: EngineConfig | None = None, log: str | Path | None = None) -> None:
        self.auto: AutoSpec = parse_auto(spec)
        candidates = tuple(dict.fromkeys(("none", *self.auto.allowed)))
        self.engine = ChoiceEngine(model, candidates, comm, config)
        self.spec = self.auto.spec
        self.names = {create(c).spec: c for c in candidates}  # canonical spec -> the user's spelling
        self._world = comm if isinstance(comm, SimWorld) else None
        self.watch = PolicyWatch(self.auto)
        self.log = PolicyLog(log if self.sim or self.engine.comm.rank == 0 else None)
        self._last_stats: StepStats | None = None  # the step commit() decides on
        self._opt_s = 0.0  # the last optimizer step's time (real backends)
        self._modelled = [0, 0]  # sim: the policy's modelled bytes sent so far per rank (all, inside nodes)

    # ------------------------------------------------------------------ the Synchronizer protocol
    @property
    def exchange(self) -> str:
        return "per bucket"

    @property
    def worker_ids(self) -> list[int]:
        return self.engine.worker_ids

    @property
    def last_schedule(self) -> list[Any]:
        return self.engine.last_schedule

    eval_on_every_rank = False  # a replicated model evaluates on rank 0

    def fp32_bytes(self, n_params: int) -> int:
        return self.engine.fp32_bytes(n_params)

    def worker(self, wid: int) -> contextlib.AbstractContextManager[Communicator]:
        return self.engine.worker(wid)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.no_sync()

    def after_backward(self, stepper: OptimizerStep) -> None:
        self.engine.after_backward(stepper)

    def synchronize(self) -> StepStats:
        self._last_stats = stats = self.engine.synchronize()
        return stats

    def commit(self, nonfinite: int, stepper: OptimizerStep) -> float:
        """The engine's commit, then the policy's turn (between steps, on every rank alike); its
        traffic is added to the step's stats (module docstring)."""
        t0 = time.perf_counter()
        norm = self.engine.commit(nonfinite, stepper)
        if not self.sim:  # the optimizer step, which metrics' step_s counts (sim's modelled step does not)
            self._opt_s = time.perf_counter() - t0
        self.watch.step()
        stats = self._last_stats
        if stats is None:
            return norm
        with self._policy_traffic(stats):
            replan = self.watch.check(stats.comm_s, lambda gap: self._agree([gap])[0])
            if replan is not None:
                self.replan(stats, replan)
        return norm

    def bind_optimizer(self, optimizer: Any) -> None:
        self.engine.bind_optimizer(optimizer)

    def detach(self) -> None:
        self.engine.detach()

    def state_dict(self) -> dict[str, Any]:
        sd = self.engine.state_dict()
        sd["spec"] = self.spec
        sd["auto"] = self.watch.state_dict()
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("spec") != self.spec:
            raise GradzipError(f"engine state is for compressor {state.get('spec')!r}, not {self.spec!r}")
        a = state.get("auto")
        if a is None:
            raise GradzipError("engine state has no auto policy state; resume with the compressor it was written with")
        self.engine.load_state_dict({**state, "spec": self.engine.spec})
        self.watch.load_state_dict(a)
        self.log.cut_after(self.watch.steps)  # a resumed run: the plans after its checkpoint go

    # ------------------------------------------------------------------ what the actuator holds
    @property
    def sim(self) -> bool:
        return self.engine.sim

    @property
    def buckets(self) -> list[Any]:
        return self.engine.buckets

    @property
    def candidates(self) -> tuple[str, ...]:
        return self.engine.candidates

    @property
    def assigned(self) -> list[str]:
        """Each bucket's candidate (canonical spec)."""
        return self.engine.assigned

    def memory(self, wid: int, index: int) -> Tensor:
        return self.engine.memory(wid, index)

    @property
    def plans(self) -> list[dict[str, Any]]:
        return self.watch.plans

    def summary(self) -> dict[str, Any]:
        """What ``summary.json`` reports of the policy."""
        return policy_summary([self.names.get(c, c) for c in self.assigned], self.watch.plans, self.watch.probe_bytes)

    # ------------------------------------------------------------------ measure
    def _n(self) -> int:
        return self.engine.world_size if not self.sim else self.engine.num_workers

    def probe_link(self) -> LinkProbe:
        """The link (between nodes, under the hierarchical exchange): sim's model (its probe's
        bytes counted), or an α–β fit of timed allreduces."""
        device = self.buckets[0].device
        if self._world is not None:
            w = self._world
            nodes = max(self._n() // w.ranks_per_node, 1) if self.engine.config.hierarchical else self._n()
            sent = modelled_probe_bytes(nodes, w.inter.latency_s, w.inter.bandwidth_bps) * nodes // self._n()
            if self.engine.config.hierarchical:  # the leaders' mean: one 3-figure allreduce of all ranks
                sent += cost.allreduce_bytes(24, self._n())
            self._modelled[0] += sent
            return LinkProbe(float(w.inter.latency_s), float(w.inter.bandwidth_bps))
        topo = self.engine.topology
        if topo is None:
            return probe_link(self.engine.comm, self.engine.world_size, device)
        # Between nodes: the node leaders' group alone (the model shares the NIC among a node's
        # groups itself); the other ranks wait, then every rank takes the leaders' mean.
        mine = (probe_link(topo.cross, topo.cross.world_size, device, "the node leaders (between nodes)")
                if topo.local_rank == 0 else LinkProbe(0.0, 0.0))
        bw = mine.bandwidth_bps
        t = torch.tensor([mine.latency_s, 1.0 / bw if bw else 0.0, mine.noise], dtype=torch.float64, device=device)
        self.engine.comm.allreduce(t, "sum")
        leaders = max(self.engine.world_size // topo.ranks_per_node, 1)
        return LinkProbe(t[0].item() / leaders, leaders / max(t[1].item(), 1e-18), t[2].item() / leaders)

    def probe_intra(self) -> tuple[int, float, float] | None:
        """Under the hierarchical exchange: (ranks per node, latency, bandwidth) inside a node, each
        node's own group probed side by side; None otherwise."""
        if not self.engine.config.hierarchical:
            return None
        if self._world is not None:
            w = self._world
            sent = modelled_probe_bytes(w.ranks_per_node, w.intra.latency_s, w.intra.bandwidth_bps)
            self._modelled[0] += sent
            self._modelled[1] += sent
            return w.ranks_per_node, float(w.intra.latency_s), float(w.intra.bandwidth_bps)
        topo = self.engine.topology
        p = probe_link(topo.node, topo.ranks_per_node, self.buckets[0].device,
                       f"the ranks of rank {self.engine.comm.rank}'s node (inside it)")
        return topo.ranks_per_node, p.latency_s, p.bandwidth_bps

    def _compressed_sizes(self) -> tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]:
        return tuple((b.numel, tuple(tuple(s) for s in b.shapes)) for b in self.buckets if b.compressed)

    def time_codecs(self) -> dict[str, CodecCost]:
        """Each candidate's encode + decode seconds per element, on buffers of the compressed buckets' sizes."""
        sizes = [(b.numel, b.shapes) for b in self.buckets if b.compressed]
        device = self.buckets[0].device if self.buckets else "cpu"
        return time_codecs(self.candidates, sizes, device, self.engine.work_time)

    def _agree(self, values: list[float]) -> list[float]:
        """The mean of each value over the ranks (sim: itself, its bytes counted): every rank plans
        from the same figures."""
        if self.sim:
            self._modelled[0] += cost.allreduce_bytes(8 * len(values), self._n())
            return values
        return agree(self.engine.comm, self.engine.world_size, values, self.buckets[0].device)

    @contextlib.contextmanager
    def _policy_traffic(self, stats: StepStats) -> Iterator[None]:
        """The policy's traffic inside this block goes to ``stats`` (the step it follows)."""
        m0 = list(self._modelled)
        with self.engine.between_steps() as real:
            yield
        sent = int(round(real["bytes_sent"])) + self._modelled[0] - m0[0]
        recv = int(round(real["bytes_recv"])) + self._modelled[0] - m0[0]  # sim: a ring allreduce's own
        stats.bytes_sent += sent
        stats.bytes_recv += recv
        stats.intra_bytes_sent += int(round(real["intra_bytes_sent"])) + self._modelled[1] - m0[1]
        stats.probe_bytes += sent
        self.watch.probe_bytes += sent

    def _sent(self) -> float:
        return self.engine.bytes_sent() + self._modelled[0]

    # ------------------------------------------------------------------ plan and act
    def replan(self, stats: StepStats, why: Replan | str) -> AutoPlan:
        """Measure (the link; the codecs unless the watch has them for a link-only re-plan), agree,
        plan, and assign every bucket its candidate from the next step on."""
        why = why if isinstance(why, Replan) else Replan(why)
        sent0 = self._sent()
        link = self.probe_link()
        intra = self.probe_intra()
        sizes = self._compressed_sizes()
        kept = self.watch.codecs(why, sizes)
        codecs = kept if kept is not None else self.time_codecs()
        specs = [s for s in self.candidates if s != "none"]
        agreed = self._agree([link.latency_s, 1.0 / link.bandwidth_bps, stats.compute_s, self._opt_s, link.noise,
                              *(codecs[s].encode_s for s in specs), *(intra[1:] if intra else ())])
        if intra is not None:  # every rank plans with the mean over the nodes
            intra, agreed = (intra[0], agreed[-2], agreed[-1]), agreed[:-2]
        probe_bytes = int(round(self._sent() - sent0))
        latency, bandwidth, compute = agreed[0], 1.0 / max(agreed[1], 1e-18), max(agreed[2], 1e-9)
        noise = agreed[4]
        codecs.update({s: CodecCost(v, 0.0, "measured") for s, v in zip(specs, agreed[5:])})
        shapes = tuple(BucketShape(tuple(tuple(s) for s in b.shapes), b.numel, b.compressed) for b in self.buckets)
        p = make_plan(self.auto, shapes, self._n(), latency, bandwidth, compute, codecs,
                      dtype_name(self.buckets[0].dtype), intra)
        for i, spec in enumerate(p.choice):
            self.engine.assign(i, spec)
        self.watch.planned(why.reason, p, noise, sizes, codecs)
        rec = plan_record(self.watch.steps, why.reason, latency, bandwidth, probe_bytes, compute, p, stats.comm_s,
                          agreed[3])
        rec.update(noise=noise, codecs_reused=kept is not None)
        if intra is not None:
            rec.update(ranks_per_node=intra[0], intra_latency_s=intra[1], intra_bandwidth_bps=intra[2])
        self.log.append(rec)
        return p
