"""What the ``auto`` policy reports: :class:`PolicyLog` (``policy.jsonl``, one line per plan, cut
back on resume), :func:`plan_record` (one line) and :func:`policy_summary` (the ``auto_*`` fields
of ``summary.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gradzip.cluster.auto import AutoPlan
from gradzip.io import atomic_write_text, read_jsonl


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


def policy_summary(chosen: list[str], plans: list[dict[str, Any]], probe_bytes: int = 0) -> dict[str, Any]:
    """The ``auto_*`` fields of ``summary.json``: plans made, buckets per candidate (``chosen``:
    each bucket's, in the user's spelling), whether the last plan found ``none`` best, and
    ``auto_probe_bytes``: the bytes this rank sent for the policy itself (its probes and
    agreements), a part of the run's bytes sent and so of its compression figure."""
    counts: dict[str, int] = {}
    for c in chosen:
        counts[c] = counts.get(c, 0) + 1
    none_best = bool(plans and plans[-1]["none_is_best"])
    out: dict[str, Any] = {"auto_plans": len(plans), "auto_choice": counts, "auto_none_is_best": none_best,
                           "auto_probe_bytes": int(probe_bytes)}
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
