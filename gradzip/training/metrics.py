"""``metrics.jsonl`` and ``summary.json`` of a training run.

``metrics.jsonl`` has one JSON object per optimizer step (``step`` counts from 1):

=============  =========================================================================
step           optimizer steps done
loss           training loss of this step (MLM + NSP), mean over all workers
mlm_loss       masked-LM part;  ``nsp_loss``: next-sentence part
lr             learning rate used by this step
tokens         cumulative non-padding tokens processed by all workers
samples        cumulative sequences processed by all workers
step_s         this step's time on the run's clock (compute + exposed comm + optimizer)
wall_s         cumulative ``step_s`` (the x-axis for loss-vs-time; excludes eval/checkpoints)
compute_s      forward+backward time of one worker (``sim``: measured, as one of N parallel workers)
compress_s     encode/decode time;  ``comm_s``: exposed (non-overlapped) communication time
opt_s          optimizer (+ clipping) time
bytes_sent     bytes this rank sent this step (``bytes_recv``: received)
bytes_inter    the part of ``bytes_sent`` that crossed between nodes (all of it unless some ranks
               share a node: ``--ranks-per-node``, or a launcher's nodes under ``--hierarchical``)
grad_norm      global gradient norm before clipping (of the averaged gradient; null when skipped)
skipped        true when some rank's gradient had an inf or NaN: every rank skipped the optimizer
               step and the compressors' state updates (the LR schedule still advances); with
               ``--sync diloco``/``localsgd``, the workers that saw it skipped their inner step
syncs          exchanges completed this step: 1 with ``--sync step``; with ``diloco``/``localsgd``,
               the fragments applied (0 between syncs; a fragment sent with ``delay`` counts, with
               its bytes, at the step it is applied), so bytes per sync = total bytes / total syncs
clock          "modelled" (``sim``: α–β network model; local work timed in CPU time) or "measured"
               (real backends: wall time)
host_load      cores other processes kept busy during this step (from ``/proc/stat``)
contended      true when this step shared its cores (a run with over 5% of its steps so is marked
               contended in ``summary.json``, results tables and figures): others left fewer free cores than the run's
               threads, the process got under 60% of its usual CPU share, or its compute time was over
               1.5x the fastest of the last 20 steps (:class:`gradzip.host.HostMonitor`)
host_s         real seconds since the run started, cumulative over resumes
bytes_allgather  ``--fsdp``/``--hsdp`` only: ``bytes_sent`` split by collective: FSDP's parameter
               all-gathers; ``bytes_reduce_scatter`` (1-D: gradzip's compressed reduce-scatter; HSDP:
               FSDP's exact one inside the node); ``bytes_allreduce`` (HSDP: gradzip's compressed
               all-reduce across the replicas, which is also ``bytes_inter``; ``--sync sparseloco
               --hsdp``: its allgather of the codes across the replicas)
eval_loss      on eval steps: held-out loss (and ``eval_mlm_loss``, ``eval_nsp_loss``), masked-token
               accuracy ``eval_mlm_acc`` (top-1 over the masked positions) and ``eval_nsp_acc``;
               on a generated language (``--corpus hmm``) also ``eval_excess_loss``, the masked-LM
               loss above the Bayes-optimal loss of the same held-out batches
ft             ``--sync ftdiloco``/``ftsparseloco``, on the steps that ran a sync: ``members``
               (the quorum), ``participants`` (weight > 0), ``heals``, ``bytes`` (per participant),
               ``weights``, ``committed``, ``digest``, ``fragment`` (docs/fault-tolerance.md)
=============  =========================================================================

:class:`StepRecord` is that record, typed; the loop fills one per step.

``schedule.json`` is the schedule of the run's last per-step exchange (not with ``--sync diloco``):
``{"step", "clock", "step_s", "spans": [{"lane", "kind", "start", "end", "bucket", "round"}]}``, times
in seconds from the start of that step's forward (:class:`gradzip.cluster.schedule.Span`): the
compute thread's backward, encodes, waits and decodes, and each round on the link. ``gradzip plot``
draws it (figure ``schedule``).

``summary.json`` is computed from the whole ``metrics.jsonl`` (so it covers resumed runs), and is
written only here: :func:`write_summary` by the loop, :func:`update_summary` by launchers that add
what only they know (the testbed's wire bytes).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gradzip.host import is_contended
from gradzip.io import atomic_write_json, atomic_write_text, read_jsonl

_BY_COLLECTIVE = ("bytes_allgather", "bytes_reduce_scatter", "bytes_allreduce")  # sharded runs only


@dataclass
class StepRecord:
    """One line of ``metrics.jsonl`` (fields: the table in the module docstring)."""

    step: int
    loss: float
    mlm_loss: float
    nsp_loss: float
    lr: float
    tokens: int
    samples: int
    step_s: float
    wall_s: float
    compute_s: float
    compress_s: float
    comm_s: float
    opt_s: float
    bytes_sent: int
    bytes_recv: int
    grad_norm: float
    clock: str
    host_s: float
    bytes_inter: int = 0
    skipped: bool = False
    syncs: int = 1
    host_load: float = 0.0
    contended: bool = False
    bytes_allgather: int | None = None
    bytes_reduce_scatter: int | None = None
    bytes_allreduce: int | None = None
    eval_loss: float | None = None
    eval_mlm_loss: float | None = None
    eval_nsp_loss: float | None = None
    eval_mlm_acc: float | None = None
    eval_nsp_acc: float | None = None
    eval_excess_loss: float | None = None
    ft: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object; the eval fields only on steps that evaluated, the per-collective bytes
        only in sharded runs, ``ft`` only on ``--sync ftdiloco``'s syncs."""
        d = asdict(self)
        return {k: v for k, v in d.items()
                if not ((k.startswith("eval_") or k in _BY_COLLECTIVE or k == "ft") and v is None)}


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a metrics file; a torn last line (crash mid-write) is skipped."""
    return [r for r in read_jsonl(path) if isinstance(r, dict) and "step" in r]


def truncate_metrics(path: str | os.PathLike[str], step: int) -> None:
    """Keep the records with ``step <= step`` (atomically), so a resumed run appends no duplicates."""
    p = Path(path)
    if not p.exists():
        return
    keep = [r for r in read_metrics(p) if r["step"] <= step]
    atomic_write_text(p, "".join(json.dumps(r) + "\n" for r in keep))


class MetricsLog:
    """Appends one JSON line per step; a no-op on ranks other than 0 (``enabled=False``).

    ``sinks`` (:mod:`gradzip.training.loggers`) get each record after it is in the file."""

    def __init__(self, path: str | os.PathLike[str], enabled: bool = True, sinks: list[Any] | None = None) -> None:
        self.path = Path(path)
        self._f = open(self.path, "a", encoding="utf-8") if enabled else None
        self.sinks = list(sinks or []) if enabled else []

    def write(self, record: StepRecord) -> None:
        if self._f is not None:
            rec = _clean(record.to_json())
            self._f.write(json.dumps(rec) + "\n")
            self._f.flush()
            for sink in self.sinks:
                sink.log(rec)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()


def _clean(rec: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN/inf: write null (a diverged loss stays visible as null, not as invalid JSON)
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}


def summarize(records: list[dict[str, Any]], info: dict[str, Any], uncompressed_bytes: int) -> dict[str, Any]:
    """``summary.json`` from the step records.

    ``uncompressed_bytes``: what one rank would send per step with ``none`` (fp32 ring allreduce
    of every gradient; sharded runs: fp32 reductions, to which the measured all-gathers are added,
    since compression leaves them alone); ``compression_ratio`` = that / the mean bytes actually sent per step
    (null with one worker, where nothing is sent).
    """
    n = len(records)
    last = records[-1] if records else {}
    evals = [r for r in records if r.get("eval_loss") is not None]
    wall = float(last.get("wall_s", 0.0))
    tokens = int(last.get("tokens", 0))
    sent = sum(r.get("bytes_sent", 0) for r in records)
    bytes_per_step = sent / n if n else 0.0
    syncs = sum(int(r.get("syncs", 1)) for r in records)

    def mean(key: str) -> float | None:
        vals = [r[key] for r in records if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    uncompressed = uncompressed_bytes + (mean("bytes_allgather") or 0.0)
    summary = {
        "final_loss": last.get("loss"),
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "final_eval_mlm_loss": evals[-1].get("eval_mlm_loss") if evals else None,
        "final_eval_mlm_acc": evals[-1].get("eval_mlm_acc") if evals else None,
        "final_eval_nsp_acc": evals[-1].get("eval_nsp_acc") if evals else None,
        "final_eval_excess_loss": evals[-1].get("eval_excess_loss") if evals else None,
        "steps": int(last.get("step", 0)),
        "tokens": tokens,
        "samples": int(last.get("samples", 0)),
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "bytes_per_step": bytes_per_step,
        "bytes_total": sent,
        "syncs": syncs,
        "bytes_per_sync": sent / syncs if syncs else None,
        "inter_bytes_per_step": sum(r.get("bytes_inter", r.get("bytes_sent", 0)) for r in records) / n if n else 0.0,
        "uncompressed_bytes_per_step": uncompressed,
        "compression_ratio": (uncompressed / bytes_per_step) if bytes_per_step > 0 else None,
        "wall_s": wall,
        "host_s": last.get("host_s"),
        "step_s": mean("step_s"),
        "compute_s": mean("compute_s"),
        "compress_s": mean("compress_s"),
        "comm_s": mean("comm_s"),
        "opt_s": mean("opt_s"),
        "clock": last.get("clock"),
        "skipped_steps": sum(1 for r in records if r.get("skipped")),
        "host_load": mean("host_load"),
        "host_load_max": max((r.get("host_load") or 0.0 for r in records), default=0.0),
        "contended_steps": sum(1 for r in records if r.get("contended")),
    }
    for op in ("allgather", "reduce_scatter", "allreduce"):  # sharded runs
        if any(f"bytes_{op}" in r for r in records):
            summary[f"{op}_bytes_per_step"] = mean(f"bytes_{op}")
    summary["contended"] = is_contended(summary["contended_steps"], n)
    if summary["contended"]:
        summary["warning"] = (f"{summary['contended_steps']} of {n} steps shared their cores with other processes "
                              f"(host load up to {summary['host_load_max']:.1f} cores); their measured times "
                              "may be inflated (see 'contended' in metrics.jsonl)")
    summary.update(info)
    return _clean(summary)


def write_summary(out: str | os.PathLike[str], summary: dict[str, Any]) -> None:
    """Write ``out/summary.json`` (atomically)."""
    atomic_write_json(Path(out) / "summary.json", _clean(summary))


def write_schedule(out: str | os.PathLike[str], step: int, clock: str, step_s: float, spans: list[Any]) -> None:
    """Write ``out/schedule.json`` (atomically): one step's :class:`~gradzip.cluster.schedule.Span` s."""
    atomic_write_json(Path(out) / "schedule.json", {"step": step, "clock": clock, "step_s": step_s,
                                                    "spans": [s.to_dict() for s in spans]}, indent=None)


def update_summary(out: str | os.PathLike[str], extra: dict[str, Any]) -> dict[str, Any]:
    """Merge ``extra`` into ``out/summary.json`` and return the result."""
    path = Path(out) / "summary.json"
    summary = json.loads(path.read_text())
    summary.update(extra)
    write_summary(out, summary)
    return summary
