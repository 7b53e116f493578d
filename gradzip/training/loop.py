"""``gradzip train``: pretrain BERT (masked LM + next sentence) under one compressor and backend.

Reads top to bottom: where we run → data → model → engine → optimizer → resume → loop → summary.
Each optimizer step, every worker computes its micro-batches (``sim``: all N workers in turn in
this process; real backends: this rank), the engine exchanges the compressed gradients, and the
optimizer steps on the averaged gradient. When some worker's gradient has an inf or NaN, every
worker skips the step instead (optimizer and compressor state untouched, ``skipped`` in the
metrics); ``cfg.max_skips`` skips in a row stop the run. With ``--sync diloco|localsgd``
(:mod:`gradzip.engine.diloco`) each worker instead steps its own inner optimizer on its local
gradient (skipping alone when it is not finite), and every H steps the pseudo-gradients are
exchanged through the compressor and an outer step merges them. Outputs in ``cfg.out`` (rank 0 writes):

- ``config.toml``: the resolved configuration (``--config`` accepts it);
- ``metrics.jsonl``: one record per step (fields: :mod:`gradzip.training.metrics`);
- ``summary.json``: final losses, tokens/s, bytes per step, compression ratio, ...;
- ``schedule.json``: the last step's schedule of encodes, waits, decodes and link rounds;
- ``ckpt-*.pt``: checkpoints (:mod:`gradzip.training.checkpoint`), the newest K kept.

Example::

    from gradzip.training.loop import TrainConfig, train
    summary = train(TrainConfig(compressor="powersgd:rank=4", workers=4, steps=200, out="runs/p4"))
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

import torch

from gradzip.engine.stats import StepStats
from gradzip.engine.synchronizer import Synchronizer
from gradzip.errors import TrainingError
from gradzip.host import HostMonitor
from gradzip.models import BertForPreTraining, bert_config
from gradzip.optim import build_optimizer
from gradzip.training import checkpoint
from gradzip.training.config import TrainConfig, write_toml
from gradzip.training.evaluate import evaluate, to_device
from gradzip.training.faults import FaultPlan
from gradzip.training.loggers import open_sinks, parse_log
from gradzip.training.metrics import (
    MetricsLog,
    StepRecord,
    read_metrics,
    summarize,
    truncate_metrics,
    write_schedule,
    write_summary,
)
from gradzip.training.precision import Precision
from gradzip.training.progress import Progress
from gradzip.training.rng import WorkerRNG, seed_everything
from gradzip.training.runtime import build_data, create_runtime
from gradzip.training.schedule import WarmupDecay
from gradzip.training.sync import Stepper, make_synchronizer, prepare_model

__all__ = ["TrainConfig", "train"]

EVAL_FIELDS = ("eval_loss", "eval_mlm_loss", "eval_nsp_loss", "eval_mlm_acc", "eval_nsp_acc", "eval_excess_loss")


def _batches(model: Any, data: Any, cfg: TrainConfig, precision: Precision, runtime: Any, step: int, w: int,
             losses: torch.Tensor, sync: Synchronizer) -> tuple[int, int]:
    """Worker ``w``'s micro-batches of ``step``: forward and backward (the synchroniser exchanges
    after the last one); adds [loss, mlm, nsp] averaged over them to ``losses``. Returns (tokens, samples)."""
    tokens = samples = 0
    for micro in range(cfg.accumulation):
        batch = data.batch("train", step=step * cfg.accumulation + micro, worker=w,
                           num_workers=runtime.num_workers, batch_size=cfg.batch_size, seed=cfg.seed,
                           mask_prob=cfg.mask_prob, whole_word_masking=cfg.whole_word_masking)
        tokens += int(batch["attention_mask"].sum())
        samples += int(batch["input_ids"].shape[0])
        last = micro == cfg.accumulation - 1  # exchange only after the last micro-batch
        with contextlib.nullcontext() if last else sync.no_sync():
            with precision.autocast():
                res = model(**to_device(batch, runtime.device))
            precision.backward(res.loss / cfg.accumulation)
        nsp = res.nsp_loss if res.nsp_loss is not None else torch.zeros_like(res.loss)  # masked LM alone
        losses += torch.stack([res.loss, res.mlm_loss, nsp]).detach().double() / cfg.accumulation
    return tokens, samples


def _build_model(cfg: TrainConfig, data: Any, runtime: Any) -> tuple[torch.nn.Module, Any]:
    """BERT on the run's device, prepared for its sync mode (``--fsdp``/``--hsdp``: sharded; returns
    HSDP's replica group)."""
    model = BertForPreTraining(bert_config(
        cfg.model, vocab_size=data.vocab_size, max_position_embeddings=max(512, cfg.seq_len),
        hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout,
        initializer_range=cfg.init_std, pre_layer_norm=cfg.pre_ln)).to(runtime.device)
    return model, prepare_model(cfg, model, runtime.num_workers, runtime.device)


def _open_out(cfg: TrainConfig, runtime: Any) -> tuple[TrainConfig, Any]:
    """The run's configuration as every rank sees it (world size, output directory) and its
    checked output directory; every rank checks before anyone writes."""
    if runtime.comm is not None:  # the launcher decides the world size, not --workers
        cfg = cfg.replace(workers=runtime.num_workers)
    # The thread count the run computes with becomes its setting (config.toml): --resume keeps it.
    cfg = cfg.replace(out=runtime.broadcast_str(cfg.out or cfg.default_out()), threads=runtime.threads)
    out = checkpoint.check_out_dir(cfg)
    if runtime.threads_warning:  # an OMP_NUM_THREADS the run's thread count overrides
        print(runtime.threads_warning, file=sys.stderr, flush=True)
    note = checkpoint.fresh_start_note(cfg, out)
    runtime.barrier()
    if runtime.is_main:  # no rank saves before the first step's collectives
        checkpoint.remove_stale_temps(out)
    if note:  # --resume auto with nothing to resume: a fresh run (a run that never checkpointed restarts)
        cfg = cfg.replace(resume=False, resume_auto=False)
        if runtime.is_main:
            print(note, file=sys.stderr, flush=True)
            truncate_metrics(out / "metrics.jsonl", 0)
    return cfg, out


def _record(progress: dict[str, Any], sums: list[float], n: int, lr: float, stats: StepStats, opt_s: float,
            grad_norm: float, monitor: HostMonitor | None) -> StepRecord:
    """The step's line of ``metrics.jsonl`` (losses: mean over the ``n`` workers), with the host's
    load and whether the step was contended."""
    loss, mlm, nsp, _, _, bad = sums
    load, contended = monitor.step([stats.compute_s]) if monitor is not None else (0.0, False)
    return StepRecord(
        step=progress["step"], loss=loss / n, mlm_loss=mlm / n, nsp_loss=nsp / n, lr=lr, tokens=progress["tokens"],
        samples=progress["samples"], step_s=stats.step_s + opt_s, wall_s=progress["wall_s"],
        compute_s=stats.compute_s, compress_s=stats.compress_s, comm_s=stats.comm_s, opt_s=opt_s,
        bytes_sent=int(stats.bytes_sent), bytes_recv=int(stats.bytes_recv), grad_norm=grad_norm,
        clock=stats.clock, host_s=progress["host_s"], bytes_inter=int(stats.bytes_sent - stats.intra_bytes_sent),
        skipped=bool(bad), syncs=stats.syncs, host_load=load, contended=contended, ft=stats.ft,
        **{f"bytes_{k}": v for k, v in (stats.by_collective or {}).items()})


def _open_log(cfg: TrainConfig, out: Any, state: checkpoint.RunState, runtime: Any, data: Any,
              precision: Precision) -> MetricsLog:
    """Resume (everything back to the newest checkpoint; later metrics dropped), the run's
    ``config.toml``, the initial held-out loss, sim's work clock (:meth:`Runtime.calibrate_clock`),
    and the metrics log with its live-curve sinks."""
    checkpoint.make_out_dir(out)
    if cfg.resume and checkpoint.restore_run(out, state, runtime) and runtime.is_main:
        truncate_metrics(out / "metrics.jsonl", state.progress["step"])
    if runtime.is_main:
        write_toml(cfg, out / "config.toml")
    if _evaluates(state.sync, runtime) and state.progress["step"] == 0 and cfg.eval_batches:
        state.progress["initial_eval_loss"] = evaluate(state.model, data, cfg, precision,
                                                       runtime.device).get("eval_loss")
    sinks = open_sinks(parse_log(cfg.log), out, cfg.to_dict(), state.progress["step"]) if runtime.is_main else []
    batch = data.batch("train", step=0, worker=0, num_workers=runtime.num_workers, batch_size=cfg.batch_size,
                       seed=cfg.seed, mask_prob=cfg.mask_prob, whole_word_masking=cfg.whole_word_masking)
    runtime.calibrate_clock(state.model, to_device(batch, runtime.device), precision.autocast)
    return MetricsLog(out / "metrics.jsonl", enabled=runtime.is_main, sinks=sinks)


def _evaluates(sync: Synchronizer, runtime: Any) -> bool:
    """Rank 0 evaluates; a sharded model's forward needs every rank (its all-gathers)."""
    return runtime.is_main or sync.eval_on_every_rank


def _evaluate_into(rec: StepRecord, cfg: TrainConfig, state: checkpoint.RunState, runtime: Any, data: Any,
                   precision: Precision, last: int) -> None:
    """The held-out loss into the step's record, when due (rank 0; sharded: every rank)."""
    step = rec.step
    due = step == last or (cfg.eval_every and step % cfg.eval_every == 0)
    if _evaluates(state.sync, runtime) and cfg.eval_batches and due:
        ev = evaluate(state.model, data, cfg, precision, runtime.device)
        for k in EVAL_FIELDS:
            setattr(rec, k, ev.get(k))


def _check_skips(cfg: TrainConfig, progress: dict[str, Any]) -> None:
    """Stop after ``--max-skips`` steps in a row skipped for inf/NaN gradients."""
    if cfg.max_skips and progress["skips_in_a_row"] >= cfg.max_skips:
        step = progress["step"]
        raise TrainingError(f"steps {step - cfg.max_skips + 1}-{step}: {cfg.max_skips} steps in a row "
                            "skipped for inf/NaN gradients on some rank (see 'skipped' in metrics.jsonl); "
                            "lower --lr, check the data, or raise --max-skips")


def _checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    """Every ``--checkpoint-every`` steps and after the last (0: none), and at ``--stop-at``."""
    every = cfg.checkpoint_every
    return bool(every and (step % every == 0 or step == cfg.steps)) or step == cfg.stop_at


def _summary(cfg: TrainConfig, out: Any, sync: Synchronizer, data: Any, n_params: int, progress: dict[str, Any],
             runtime: Any, last_schedule: tuple[int, StepStats, list[Any]] | None) -> dict[str, Any]:
    """``summary.json`` (from the whole metrics file, so resumed runs are covered) and ``schedule.json``."""
    info = {"model": cfg.model, "compressor": cfg.compressor, "sync": str(cfg.sync_spec), "exchange": sync.exchange,
            "spec": sync.spec, "hierarchical": cfg.hierarchical, "sharding": cfg.sharding, "backend": cfg.backend,
            "workers": runtime.num_workers, "bandwidth": cfg.bandwidth, "latency": cfg.latency,
            "optimizer": cfg.optimizer, "precision": cfg.precision, "batch_size": cfg.batch_size,
            "accumulation": cfg.accumulation, "seq_len": cfg.seq_len, "lr": cfg.lr, "seed": cfg.seed,
            "params": n_params, "initial_eval_loss": progress["initial_eval_loss"], "out": str(out),
            "threads": runtime.threads, "threads_requested": runtime.threads_requested,
            "threads_reason": runtime.threads_reason,
            "compute_clock": "cpu" if runtime.world is not None else "wall", "work_scale": runtime.work_scale}
    # what a model that ignores context gets (gradzip.data.pretrain.UnigramReference)
    ref = data.unigram_reference()
    info.update(unigram_entropy=ref.entropy, top_token_rate=ref.top_rate, context_free_mlm_loss=ref.floor,
                context_free_mlm_acc=ref.floor_acc,
                optimal_mlm_loss=data.optimal_mlm_loss(batch_size=cfg.batch_size, max_batches=cfg.eval_batches))
    info.update(sync.summary())  # the mode's own fields (--compressor auto: its plans and choice)
    summary = summarize(read_metrics(out / "metrics.jsonl"), info, sync.fp32_bytes(n_params))
    write_summary(out, summary)
    if last_schedule is not None and last_schedule[2]:
        write_schedule(out, last_schedule[0], last_schedule[1].clock, last_schedule[1].step_s, last_schedule[2])
    return summary


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or with ``cfg.resume``, continue) one training run; return the summary (rank 0; other
    ranks of a real backend return ``{"rank": r}``). Bad settings raise GradzipError before
    anything in ``cfg.out`` is created or changed."""
    # -- where we run: sim world or this rank's communicator; the output directory --------------
    cfg.check_runtime()
    faults = FaultPlan.from_env()  # GRADZIP_FAULT: chaos tests (gradzip.training.faults)
    runtime = create_runtime(cfg)
    log: MetricsLog | None = None
    try:
        cfg, out = _open_out(cfg, runtime)

        # -- data and model (same seed: same initial weights on every rank) --------------------
        seed_everything(cfg.seed)
        data = build_data(cfg, runtime)
        model, replicas = _build_model(cfg, data, runtime)
        params = [p for p in model.parameters() if p.requires_grad]

        # -- optimizer, synchroniser (per-step exchange, or DiLoCo's rare syncs), LR schedule,
        # precision, per-worker RNG streams; then resume and the outputs --------------------------
        optimizer = build_optimizer(cfg.optimizer, model, cfg.lr, cfg.weight_decay, cfg.freeze_steps, cfg.momentum)
        sync = make_synchronizer(cfg, model, optimizer, runtime, replicas)
        schedule = WarmupDecay(optimizer, cfg.lr, cfg.warmup_steps, cfg.steps)
        precision = Precision(cfg.precision, runtime.device)
        stepper = Stepper(optimizer, params, precision, cfg.clip)
        rngs = WorkerRNG(cfg.seed, list(sync.worker_ids), runtime.device)
        progress: dict[str, Any] = {"step": 0, "tokens": 0, "samples": 0, "wall_s": 0.0, "host_s": 0.0,
                                    "initial_eval_loss": None, "skips_in_a_row": 0}
        state = checkpoint.RunState(model, optimizer, schedule, precision, sync, rngs, progress, cfg.to_dict())
        log = _open_log(cfg, out, state, runtime, data, precision)

        # -- the loop: every worker's batches and backward, the synchronisation, the skip decision
        last, n = cfg.stop_at or cfg.steps, runtime.num_workers
        bar = Progress(cfg.progress and runtime.is_main, total=last, initial=progress["step"])
        t_start = time.perf_counter() - progress["host_s"]
        last_schedule: tuple[int, StepStats, list[Any]] | None = None
        model.train()
        while progress["step"] < last:
            step, lr = progress["step"], schedule.lr
            losses, tokens, samples = torch.zeros(3, dtype=torch.float64, device=runtime.device), 0, 0  # over workers
            runtime.monitor.start()  # this step's window: evaluation and checkpoints are no step's load
            for w in sync.worker_ids:
                faults.before_step(step + 1, w)
                with rngs.use(w), sync.worker(w):  # worker w: its dropout stream, its state (sim)
                    with faults.gradients(model, step + 1, w):
                        t, s = _batches(model, data, cfg, precision, runtime, step, w, losses, sync)
                    sync.after_backward(stepper)  # local-step modes: w's own optimizer step (or skip)
                tokens, samples = tokens + t, samples + s
            stats = sync.synchronize()  # the exchange: bytes, times, workers with inf/NaN
            last_schedule = (step + 1, stats, sync.last_schedule)
            # -- metrics, and how many workers saw inf/NaN, summed over ranks (real backends: the
            # flag rides on this reduction, which is not counted as exchange bytes; sim: local) --
            sums = runtime.sum_over_ranks([*losses.tolist(), tokens, samples, stats.nonfinite])
            t_opt = runtime.work_time()
            grad_norm = sync.commit(int(sums[5]), stepper)  # the optimizer steps, or every rank skips
            progress["skips_in_a_row"] = progress.get("skips_in_a_row", 0) + 1 if sums[5] else 0
            schedule.step()
            opt_s = runtime.work_time() - t_opt
            progress.update(step=step + 1, tokens=progress["tokens"] + int(sums[3]),
                            samples=progress["samples"] + int(sums[4]),
                            wall_s=progress["wall_s"] + stats.step_s + opt_s, host_s=time.perf_counter() - t_start)
            rec = _record(progress, sums, n, lr, stats, opt_s, grad_norm, runtime.monitor)
            _evaluate_into(rec, cfg, state, runtime, data, precision, last)
            log.write(rec)
            bar.update(rec, sums[3])
            _check_skips(cfg, progress)
            if _checkpoint_due(cfg, step + 1):
                checkpoint.save_run(out, state, runtime, cfg.keep_checkpoints)
        bar.close()
        log.close()
        log = None
        if not runtime.is_main:
            return {"rank": runtime.rank}
        return _summary(cfg, out, sync, data, sum(p.numel() for p in params), progress, runtime, last_schedule)
    finally:
        if log is not None:  # an error: still flush and close the live-curve sinks
            log.close()
        runtime.close()
