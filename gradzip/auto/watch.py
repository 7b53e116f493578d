"""When the ``auto`` policy plans again: :class:`PolicyWatch`, the one rule of both actuators, the
engine (:class:`gradzip.engine.auto.AutoEngine`: a step is a commit) and the DDP comm hook
(:class:`gradzip.engine.ddp_auto.AutoHookState`: a step is an iteration's last bucket).

The rule, checked after every step, on every rank alike (a re-plan is collective):

1. **First plan** once ``first_at = max(warmup, min_steps)`` steps are done (``min_steps``: what
   the actuator needs before its first measurement; DDP: 2, its buckets are rebuilt after the first
   iteration).
2. **Off the prediction**: a step is off when the ranks' mean gap between the measured exposed
   communication and the plan's prediction exceeds

       max(tolerance × predicted step,  noise × predicted link time)

   where ``noise`` is the host's, measured by the plan's link probe: the relative spread
   (slowest − fastest) / fastest of its repeated allreduces of one size (ranks' mean). A gap no
   larger than what the very same transfer varies by on this host says nothing about the link,
   so it does not send another probe. On a quiet host (and on ``sim``, whose probe is the model)
   ``noise`` is 0 and ``tolerance`` alone decides.
3. ``patience`` steps in a row off: re-plan, **link only**. The watched figure is communication
   (encode and decode are not in it), so only the link is probed again; the codec timings of the
   last plan are reused when they were measured on the same buckets (:meth:`PolicyWatch.codecs`).
4. Otherwise, every ``replan_every`` steps: re-plan, measuring everything (the codecs too, which a
   host's load changes slowly).

The counters, the prediction, the plans made and the policy's own bytes are checkpoint state
(:meth:`PolicyWatch.state_dict`); the remembered codec timings are not (a resumed run times them
at its next re-plan).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from gradzip.cluster.auto import AutoPlan
from gradzip.cluster.network import CodecCost
from gradzip.plan.auto import AutoSpec


@dataclass(frozen=True)
class Replan:
    """A decision to plan again: why (``policy.jsonl``'s ``reason``), and whether only the link
    is in question (the codec timings may be reused)."""

    reason: str
    link_only: bool = False


class PolicyWatch:
    """The auto policy's counters and re-plan rule (module docstring). ``min_steps``: steps the
    actuator needs before it can measure (the engine 0, the DDP hook 2)."""

    def __init__(self, auto: AutoSpec, min_steps: int = 0) -> None:
        self.auto = auto
        self.first_at = max(auto.warmup, min_steps)
        self.first_reason = "first plan" if auto.warmup <= min_steps else f"after {auto.warmup} warm-up steps"
        self.steps = 0            # steps done
        self.planned_at = -1      # step of the last plan (-1: none yet)
        self.drift = 0            # steps in a row off the prediction
        self.prediction: dict[str, float] = {}
        self.plans: list[dict[str, Any]] = []
        self.probe_bytes = 0      # bytes this rank sent for the policy (probes, agreements)
        self._codecs: tuple[Hashable, dict[str, CodecCost]] | None = None

    def step(self) -> None:
        """One step done."""
        self.steps += 1

    def threshold(self) -> float:
        """The gap (seconds) above which a step counts as off the prediction (rule 2)."""
        p = self.prediction
        return max(self.auto.tolerance * p["step_s"], p.get("noise", 0.0) * p.get("link_s", 0.0))

    def check(self, comm_s: float, agree: Callable[[float], float]) -> Replan | None:
        """After a step whose measured exposed communication is ``comm_s``: plan again now, or not.
        ``agree`` maps this rank's gap to the ranks' mean (a collective, called on every rank once
        a plan exists, so that every rank decides alike)."""
        if self.steps < self.first_at:
            return None
        if self.planned_at < 0:
            return Replan(self.first_reason)
        gap = agree(abs(comm_s - self.prediction["comm_s"]))
        self.drift = self.drift + 1 if gap > self.threshold() else 0
        if self.drift >= self.auto.patience:
            return Replan(f"measured communication off the prediction for {self.drift} steps", link_only=True)
        if self.auto.replan_every and self.steps - self.planned_at >= self.auto.replan_every:
            return Replan(f"every {self.auto.replan_every} steps")
        return None

    def codecs(self, replan: Replan, buckets: Hashable) -> dict[str, CodecCost] | None:
        """The codec timings to reuse for ``replan`` (those of the last plan, when only the link is in
        question and ``buckets``, the compressed buckets' sizes, are the ones they were timed on), or
        None: time them again."""
        if replan.link_only and self._codecs is not None and self._codecs[0] == buckets:
            return dict(self._codecs[1])
        return None

    def planned(self, reason: str, p: AutoPlan, noise: float, buckets: Hashable, codecs: dict[str, CodecCost],
                compute_s: float | None = None) -> None:
        """A plan was made at this step: its prediction (and the host's ``noise``) is what the next
        steps are compared with; ``codecs`` (timed on ``buckets``) may serve a link-only re-plan."""
        self.planned_at, self.drift = self.steps, 0
        self.prediction = {"step_s": p.step_s, "comm_s": p.comm_s, "link_s": p.link_s, "noise": noise}
        if compute_s is not None:
            self.prediction["compute_s"] = compute_s
        self.plans.append({"step": self.steps, "reason": reason, "none_is_best": p.none_is_best})
        self._codecs = (buckets, dict(codecs))

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "planned_at": self.planned_at, "drift": self.drift,
                "prediction": dict(self.prediction), "plans": list(self.plans), "probe_bytes": self.probe_bytes}

    def load_state_dict(self, a: dict[str, Any]) -> None:
        self.steps, self.planned_at, self.drift = int(a["steps"]), int(a["planned_at"]), int(a["drift"])
        self.prediction, self.plans = dict(a["prediction"]), list(a["plans"])
        self.probe_bytes = int(a.get("probe_bytes", 0))
