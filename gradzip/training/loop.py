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
import time
from typing import Any

import torch

from gradzip.comm.cost import allreduce_bytes
from gradzip.engine import attach
from gradzip.engine.diloco import DiLoCo, outer_sgd
from gradzip.engine.stats import StepStats
from gradzip.errors import TrainingError
from gradzip.models import BertForPreTraining, bert_config
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
from gradzip.training.optim import WarmupDecay, build_optimizer
from gradzip.training.precision import Precision
from gradzip.training.progress import Progress
from gradzip.training.rng import WorkerRNG, seed_everything
from gradzip.training.runtime import build_data, create_runtime

__all__ = ["TrainConfig", "train"]


def _batches(model: Any, data: Any, cfg: TrainConfig, precision: Precision, runtime: Any, step: int, w: int,
             losses: torch.Tensor, engine: Any = None) -> tuple[int, int]:
    """Worker ``w``'s micro-batches of ``step``: forward and backward (the engine, when given,
    exchanges after the last one); adds [loss, mlm, nsp] averaged over them to ``losses``.
    Returns (tokens, samples)."""
    tokens = samples = 0
    for micro in range(cfg.accumulation):
        batch = data.batch("train", step=step * cfg.accumulation + micro, worker=w,
                           num_workers=runtime.num_workers, batch_size=cfg.batch_size, seed=cfg.seed,
                           mask_prob=cfg.mask_prob)
        tokens += int(batch["attention_mask"].sum())
        samples += int(batch["input_ids"].shape[0])
        sync = engine is None or micro == cfg.accumulation - 1  # exchange only after the last micro-batch
        with contextlib.nullcontext() if sync else engine.no_sync():
            with precision.autocast():
                res = model(**to_device(batch, runtime.device))
            precision.backward(res.loss / cfg.accumulation)
        losses += torch.stack([res.loss, res.mlm_loss, res.nsp_loss]).detach().double() / cfg.accumulation
    return tokens, samples


def _finite(params: list[torch.Tensor]) -> bool:
    """True when every gradient is finite (one host sync; an overflowing fp32 sum counts as not)."""
    sums = [torch.sum(p.grad, dtype=torch.float32) for p in params if p.grad is not None]
    return not sums or bool(torch.isfinite(torch.stack(sums).sum()))


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
        if runtime.comm is not None:  # the launcher decides the world size, not --workers
            cfg = cfg.replace(workers=runtime.num_workers)
        cfg = cfg.replace(out=runtime.broadcast_str(cfg.out or cfg.default_out()))
        out = checkpoint.check_out_dir(cfg)  # every rank checks before anyone writes
        runtime.barrier()
        if runtime.is_main:  # no rank saves before the first step's collectives
            checkpoint.remove_stale_temps(out)

        # -- data and model (same seed: same initial weights on every rank) --------------------
        seed_everything(cfg.seed)
        data = build_data(cfg, runtime)
        model_cfg = bert_config(cfg.model, vocab_size=data.vocab_size, max_position_embeddings=max(512, cfg.seq_len),
                                hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout)
        model = BertForPreTraining(model_cfg).to(runtime.device)
        params = [p for p in model.parameters() if p.requires_grad]

        # -- engine (per-step exchange, or DiLoCo's rare syncs), optimizer, LR schedule, precision,
        # per-worker RNG streams ---------------------------------------------------------------
        sync = cfg.sync_spec
        optimizer = build_optimizer(cfg.optimizer, model, cfg.lr, cfg.weight_decay, cfg.freeze_steps, cfg.momentum)
        if sync.outer:  # the inner optimizer steps on local gradients; DiLoCo syncs every H steps
            engine: Any = DiLoCo(model, optimizer, outer_sgd(model, sync), runtime.target, sync.every, cfg.spec,
                                 sync.fragments, sync.delay, sync.alpha, bucket_cap_mb=cfg.bucket_cap_mb,
                                 min_compress_numel=cfg.min_compress_numel, hierarchical=cfg.hierarchical,
                                 intra_dtype=cfg.intra_dtype, agree=cfg.agreement(), hook=False)
        else:
            engine = attach(model, cfg.spec, runtime.target, bucket_cap_mb=cfg.bucket_cap_mb,
                            min_compress_numel=cfg.min_compress_numel, agree=cfg.agreement(),
                            hierarchical=cfg.hierarchical, intra_dtype=cfg.intra_dtype)
        configure = getattr(optimizer, "configure", None)  # 1-bit Adam/LAMB: what the engine exchanges
        schedule = WarmupDecay(optimizer, cfg.lr, cfg.warmup_steps, cfg.steps)
        precision = Precision(cfg.precision, runtime.device)
        rngs = WorkerRNG(cfg.seed, list(engine.worker_ids), runtime.device)
        progress: dict[str, Any] = {"step": 0, "tokens": 0, "samples": 0, "wall_s": 0.0, "host_s": 0.0,
                                    "initial_eval_loss": None, "skips_in_a_row": 0}
        state = checkpoint.RunState(model, optimizer, schedule, precision, engine, rngs, progress, cfg.to_dict())

        # -- resume: everything back to the newest checkpoint; drop later metrics --------------
        checkpoint.make_out_dir(out)
        metrics_path = out / "metrics.jsonl"
        if cfg.resume and checkpoint.restore_run(out, state, runtime) and runtime.is_main:
            truncate_metrics(metrics_path, progress["step"])
        if runtime.is_main:
            write_toml(cfg, out / "config.toml")
            if progress["step"] == 0 and cfg.eval_batches:
                progress["initial_eval_loss"] = evaluate(model, data, cfg, precision, runtime.device).get("eval_loss")
        sinks = open_sinks(parse_log(cfg.log), out, cfg.to_dict(), progress["step"]) if runtime.is_main else []
        log = MetricsLog(metrics_path, enabled=runtime.is_main, sinks=sinks)

        # -- the loop ----------------------------------------------------------------------------
        last, n = cfg.stop_at or cfg.steps, runtime.num_workers
        bar = Progress(cfg.progress and runtime.is_main, total=last, initial=progress["step"])
        t_start = time.perf_counter() - progress["host_s"]
        model.train()
        last_schedule: tuple[int, StepStats, list[Any]] | None = None
        while progress["step"] < last:
            step = progress["step"]
            lr = schedule.lr
            losses = torch.zeros(3, dtype=torch.float64, device=runtime.device)  # loss, mlm, nsp summed over workers
            momentum = configure is not None and optimizer.frozen  # p.grad will hold the averaged momentum
            if configure is not None:
                configure(engine)
            tokens = samples = 0
            if sync.outer:  # each worker: its batches, then its own inner step (skipped alone if not finite)
                t_inner = time.perf_counter()
                norms, bad = [], 0
                for w in engine.worker_ids:
                    faults.before_step(step + 1, w)
                    with engine.worker(w):  # sim: worker w's replica and inner optimizer state
                        optimizer.zero_grad(set_to_none=True)
                        with rngs.use(w), faults.gradients(model, step + 1, w):
                            t, s = _batches(model, data, cfg, precision, runtime, step, w, losses)
                        tokens, samples = tokens + t, samples + s
                        if _finite(params):
                            norms.append(precision.step(optimizer, params, cfg.clip))
                        else:
                            precision.skip()
                            bad += 1
                compute = (time.perf_counter() - t_inner) / len(engine.worker_ids)
                synced = engine.after_inner_step(compute)  # sends/applies the fragments due now
                stats = StepStats(compute_s=compute, compress_s=synced.compress_s, comm_s=synced.exposed_s,
                                  bytes_sent=synced.bytes_sent, bytes_recv=synced.bytes_recv,
                                  step_s=compute + synced.compress_s + synced.exposed_s,
                                  clock="modelled" if runtime.comm is None else runtime.comm.clock,
                                  link_s=synced.link_s, intra_bytes_sent=synced.intra_bytes_sent)
                loss, mlm, nsp, tokens, samples, bad = runtime.sum_over_ranks([*losses.tolist(), tokens, samples, bad])
                grad_norm = sum(norms) / len(norms) if norms else float("nan")
                progress["skips_in_a_row"] = progress.get("skips_in_a_row", 0) + 1 if bad else 0
                t_opt = time.perf_counter()
            else:
                for w in engine.worker_ids:
                    faults.before_step(step + 1, w)
                    with rngs.use(w), engine.worker(w), faults.gradients(model, step + 1, w):
                        # worker w: its dropout stream, its compressor state
                        t, s = _batches(model, data, cfg, precision, runtime, step, w, losses, engine)
                        tokens, samples = tokens + t, samples + s
                stats = engine.finalize()  # averaged gradients are in p.grad now
                last_schedule = (step + 1, stats, engine.last_schedule)

                # -- metrics, and how many workers saw inf/NaN, summed over ranks (real backends: the
                # flag rides on this reduction, which is not counted as exchange bytes; sim: local) --
                loss, mlm, nsp, tokens, samples, bad = runtime.sum_over_ranks(
                    [*losses.tolist(), tokens, samples, stats.nonfinite])
                t_opt = time.perf_counter()
                if bad:  # every rank takes this branch: skip the optimizer and the compressors' updates
                    engine.skip_step()
                    precision.skip()
                    grad_norm = float("nan")
                    progress["skips_in_a_row"] = progress.get("skips_in_a_row", 0) + 1
                else:
                    grad_norm = precision.step(optimizer, params, 0.0 if momentum else cfg.clip)
                    progress["skips_in_a_row"] = 0
            schedule.step()
            opt_s = time.perf_counter() - t_opt
            progress["step"] = step = step + 1
            progress["tokens"] += int(tokens)
            progress["samples"] += int(samples)
            progress["wall_s"] += stats.step_s + opt_s
            progress["host_s"] = time.perf_counter() - t_start
            rec = StepRecord(
                step=step, loss=loss / n, mlm_loss=mlm / n, nsp_loss=nsp / n, lr=lr, tokens=progress["tokens"],
                samples=progress["samples"], step_s=stats.step_s + opt_s, wall_s=progress["wall_s"],
                compute_s=stats.compute_s, compress_s=stats.compress_s, comm_s=stats.comm_s, opt_s=opt_s,
                bytes_sent=int(stats.bytes_sent), bytes_recv=int(stats.bytes_recv), grad_norm=grad_norm,
                clock=stats.clock, host_s=progress["host_s"],
                bytes_inter=int(stats.bytes_sent - stats.intra_bytes_sent), skipped=bool(bad),
                syncs=synced.applied if sync.outer else 1)
            eval_now = step == last or (cfg.eval_every and step % cfg.eval_every == 0)
            if runtime.is_main and cfg.eval_batches and eval_now:
                ev = evaluate(model, data, cfg, precision, runtime.device)
                for k in ("eval_loss", "eval_mlm_loss", "eval_nsp_loss", "eval_mlm_acc", "eval_nsp_acc"):
                    setattr(rec, k, ev.get(k))
            log.write(rec)
            bar.update(rec, tokens)
            if cfg.max_skips and progress["skips_in_a_row"] >= cfg.max_skips:
                raise TrainingError(f"steps {step - cfg.max_skips + 1}-{step}: {cfg.max_skips} steps in a row "
                                    "skipped for inf/NaN gradients on some rank (see 'skipped' in metrics.jsonl); "
                                    "lower --lr, check the data, or raise --max-skips")
            every = cfg.checkpoint_every
            if (every and (step % every == 0 or step == cfg.steps)) or step == cfg.stop_at:
                checkpoint.save_run(out, state, runtime, cfg.keep_checkpoints)
        bar.close()
        log.close()
        log = None

        # -- summary (from the whole metrics file, so resumed runs are covered) ------------------
        if not runtime.is_main:
            return {"rank": runtime.rank}
        info = {"model": cfg.model, "compressor": cfg.compressor, "sync": str(sync),
                "exchange": engine.compressors[0].exchange if sync.outer else engine.compressor.exchange,
                "spec": engine.spec,
                "hierarchical": cfg.hierarchical,
                "backend": cfg.backend, "workers": n,
                "bandwidth": cfg.bandwidth, "latency": cfg.latency, "optimizer": cfg.optimizer,
                "precision": cfg.precision, "batch_size": cfg.batch_size, "accumulation": cfg.accumulation,
                "seq_len": cfg.seq_len, "lr": cfg.lr, "seed": cfg.seed, "params": sum(p.numel() for p in params),
                "initial_eval_loss": progress["initial_eval_loss"], "out": str(out)}
        # what a model that ignores context gets (gradzip.data.pretrain.UnigramReference)
        ref = data.unigram_reference()
        info.update(unigram_entropy=ref.entropy, top_token_rate=ref.top_rate, context_free_mlm_loss=ref.floor,
                    context_free_mlm_acc=ref.floor_acc)
        none_bytes = allreduce_bytes(4 * info["params"], runtime.num_workers)  # fp32 ring allreduce of every gradient
        summary = summarize(read_metrics(metrics_path), info, none_bytes)
        write_summary(out, summary)
        if last_schedule is not None and last_schedule[2]:
            write_schedule(out, last_schedule[0], last_schedule[1].clock, last_schedule[1].step_s, last_schedule[2])
        return summary
    finally:
        if log is not None:  # an error: still flush and close the live-curve sinks
            log.close()
        runtime.close()
