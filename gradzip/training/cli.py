"""``gradzip train``: the command line of :func:`gradzip.training.loop.train`.

Configuration: defaults < the saved ``config.toml`` of ``--out`` (with ``--resume``) <
``--config FILE.toml`` < flags given on the command line.

Launching, for ``--backend gloo|nccl|mpi``:

- under an external launcher (torchrun, mpirun/mpiexec, srun: detected from the environment),
  this process is one rank and the world size comes from the launcher (``--workers`` is ignored);
- otherwise ``gradzip train`` starts ``--workers`` local processes itself
  (:func:`gradzip.comm.launch.spawn_local`; ``mpi`` uses the environment's ``mpirun``) and waits
  for them. The children carry ``GRADZIP_TRAIN_CHILD=1`` and the launcher's variables, so they
  never spawn again. The parent checks ``--out`` and builds the data cache first.
- ``--netem HOSTS:RATE`` runs the ranks inside the network testbed instead: the launch goes
  through ``gradzip.training.launch.launch_in_testbed(cfg, argv, env_extra) -> int`` (see
  :func:`_launch`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from gradzip.comm.launch import detect_launcher_env, spawn_local
from gradzip.engine.modes import check_machine
from gradzip.errors import GradzipError
from gradzip.host import choose_threads
from gradzip.optim.registry import optimizer_help
from gradzip.training.checkpoint import check_out_dir
from gradzip.training.config import BACKENDS, DEVICES, OPTIMIZERS, PRECISIONS, TrainConfig, load_toml, write_toml
from gradzip.training.faults import FaultPlan
from gradzip.training.launch import launch_in_testbed
from gradzip.training.loop import train
from gradzip.training.runtime import LAUNCH_MARKER, Runtime, build_data
from gradzip.training.sharding import ranks_per_node

DEFAULTS = TrainConfig()  # defaults, for the help texts


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Flags not given stay absent (SUPPRESS), so that --config and a resumed run's settings apply.
    def flag(group: Any, name: str, help: str, show_default: bool = True, **kw: Any) -> None:
        dest = kw.get("dest", name[2:].replace("-", "_"))
        if show_default:
            d = getattr(DEFAULTS, dest)
            help += f" (default {d:g})" if isinstance(d, float) else f" (default {d})"
        group.add_argument(name, default=argparse.SUPPRESS, help=help, **kw)

    g = p.add_argument_group("what to train")
    flag(g, "--model", "bert-tiny|bert-mini|bert-small|bert-medium|bert-base|bert-large")
    flag(g, "--pre-ln", "pre-LayerNorm blocks (LayerNorm before the attention and the feed-forward, one after the "
         "last layer: Hugging Face's RobertaPreLayerNorm) instead of BERT's post-LN", show_default=False,
         action="store_true")
    flag(g, "--compressor", "compressor spec, e.g. powersgd:rank=4 or topk:ratio=0.01,ef=true (see gradzip ls)",
         metavar="SPEC")
    flag(g, "--exchange", "how payloads combine, one of the compressor's schemes (gradzip ls): allgather, allreduce, "
         "twophase (compressed allreduce); default: the compressor's own, or the spec's exchange=", show_default=False,
         metavar="SCHEME")
    flag(g, "--sync", "when workers synchronise: step (exchange gradients every step); diloco:every=H[,outer_lr=0.7,"
         "momentum=0.9,fragments=P,delay=T,alpha=A] (H local steps, then an outer Nesterov step on the averaged "
         "pseudo-gradient, sent through --compressor); localsgd:every=H (average parameters)", metavar="MODE")
    # Choices and help come from the registry (gradzip.optim.registry): registered before this runs.
    flag(g, "--optimizer", optimizer_help(), choices=OPTIMIZERS)
    flag(g, "--freeze-step", "onebit-adam/-lamb: warm-up steps before the variance freezes and the momentum is "
         "compressed (below 1: a fraction of --steps)", type=float)
    flag(g, "--lr", "peak learning rate", type=float)
    flag(g, "--momentum", "--optimizer sgd: heavy-ball momentum in [0, 1)", type=float)
    flag(g, "--warmup", "linear warm-up in steps, or a fraction of --steps if below 1; then linear decay "
         "to 0 at --steps", type=float)
    flag(g, "--dropout", "BERT's hidden and attention dropout probability (0 for short runs that should "
         "learn fast)", type=float)
    flag(g, "--init-std", "standard deviation of the initial weights (BERT's initializer_range, 0.02)",
         type=float)
    flag(g, "--weight-decay", "decoupled; not applied to biases and LayerNorm", type=float)
    flag(g, "--clip", "clip the global gradient norm to this (0: off)", type=float)
    flag(g, "--precision", "fp32; bf16 autocast (CPU or CUDA); fp16 autocast + gradient scaling (CUDA only)",
         choices=PRECISIONS)
    flag(g, "--seed", "seeds the model init, data order and masking, dropout", type=int)
    flag(g, "--max-skips", "a step whose gradient is not finite on some rank is skipped on every rank; stop with "
         "an error after this many skipped in a row (0: never stop)", type=int)

    g = p.add_argument_group("batch and length")
    flag(g, "--batch-size", "sequences per worker per micro-step", type=int)
    flag(g, "--accumulation", "micro-steps per optimizer step (gradient accumulation)", type=int)
    flag(g, "--seq-len", "tokens per sequence, at most 512", type=int)
    flag(g, "--steps", "optimizer steps", type=int)
    flag(g, "--stop-at", "stop (with a checkpoint) after this step, keeping the LR schedule of --steps; "
         "continue later with --resume", show_default=False, type=int, metavar="STEP")

    g = p.add_argument_group("workers and network")
    flag(g, "--backend", "sim: N workers in this process on a modelled network; gloo/nccl (torch.distributed), "
         "mpi (mpi4py): one process per worker", choices=BACKENDS)
    flag(g, "--workers", "workers: sim, or local processes started by this command (under torchrun/mpirun/srun "
         "the launcher decides)", type=int)
    flag(g, "--bandwidth", "sim: link bandwidth, e.g. 1gbit, 100mbit")
    flag(g, "--latency", "sim: per-message latency, e.g. 50us")
    flag(g, "--hierarchical", "reduce in full precision inside each node, compress only between nodes",
         show_default=False, action="store_true")
    flag(g, "--fsdp", "shard the model over all ranks with FSDP2 (one unit per encoder layer, then the root) "
         "and compress its reduce-scatter (docs/fsdp.md)", show_default=False, action=_Sharding, const="fsdp",
         dest="sharding")
    flag(g, "--hsdp", "shard inside each node of --ranks-per-node ranks (two nodes or more), replicate across "
         "nodes, and compress the replica all-reduce (docs/fsdp.md)", show_default=False, action=_Sharding,
         const="hsdp", dest="sharding")
    flag(g, "--ef-dtype", "--fsdp/--hsdp: the error memory's dtype (bf16: half the memory)", choices=("fp32", "bf16"))
    flag(g, "--intra-dtype", "the hierarchical exchange's wire dtype inside a node: native (the gradient's own dtype), "
         "fp16 or bf16", choices=("native", "fp16", "bf16"))
    flag(g, "--ranks-per-node", "workers per node: sim; local processes (--workers) and --netem hosts emulate "
         "nodes of this size (default: sim 1, else from the launcher: GROUP_RANK, SLURM_NODEID, host name)",
         show_default=False, type=int)
    flag(g, "--intra-bandwidth", "sim: link bandwidth inside a node")
    flag(g, "--intra-latency", "sim: per-message latency inside a node")
    flag(g, "--bucket-cap-mb", "gradient bucket size in MB", type=float)
    flag(g, "--min-compress-numel", "tensors with fewer elements go uncompressed", type=int)
    flag(g, "--timeout", "seconds allowed for init and for each collective", type=float)
    flag(g, "--device", "auto: CUDA if available", choices=DEVICES)
    flag(g, "--threads", "torch's intra-op threads per process (default: OMP_NUM_THREADS, else the cores free at "
         "start-up); the count used is saved in config.toml, and --resume keeps it, since it changes how sums "
         "round", show_default=False, type=int, metavar="N")
    flag(g, "--netem", "run HOSTS ranks in the network testbed (root), one emulated host each, e.g. 4:100mbit "
         "or 4:1gbit:0.1ms:0.01, or 2:unshaped for no rate limit (see gradzip netem --help)", show_default=False,
         metavar="HOSTS:RATE[:DELAY[:LOSS%]]")
    flag(g, "--netem-trace", "--netem: change the testbed's rate while the run goes on, from FILE's 'time, rate' rows "
         "(or a shipped trace's, e.g. 10gbit-100mbit-30s), from the launch on, repeating; changes logged to "
         "link.jsonl in --out", show_default=False, metavar="FILE")

    g = p.add_argument_group("data")
    flag(g, "--corpus", "text file or directory, JSONL with a 'text' field, or hf:NAME (default: the built-in "
         "corpus)", show_default=False, metavar="PATH|hf:NAME")
    flag(g, "--vocab-size", "WordPiece vocabulary size (default: the model's)", show_default=False, type=int)
    flag(g, "--mask-prob", "share of tokens masked in training batches (BERT 0.15; 0.4 learns faster, "
         "Wettig et al. 2023); held-out batches always mask 0.15", type=float)
    flag(g, "--whole-word-masking", "mask all WordPiece pieces of a chosen word together, words chosen until "
         "--mask-prob of the tokens are (BERT's whole-word masking); held-out batches stay token-masked",
         show_default=False, action="store_true")
    flag(g, "--tokenizer", "use this vocab.txt or tokenizer.json instead of training a WordPiece vocabulary on "
         "the corpus", show_default=False, metavar="FILE")

    g = p.add_argument_group("evaluation, checkpoints, outputs")
    flag(g, "--eval-every", "held-out loss every N steps and after the last (0: only after the last)", type=int)
    flag(g, "--eval-batches", "held-out batches per evaluation (0: no evaluation)", type=int)
    flag(g, "--checkpoint-every", "checkpoint every N steps and after the last (0: none)", type=int)
    flag(g, "--keep-checkpoints", "how many of the newest checkpoints are kept", type=int)
    flag(g, "--out", "output directory; must be new or empty (default runs/<model>-<compressor>-<backend><N>-<time>)",
         show_default=False, metavar="DIR")
    flag(g, "--resume", "continue the run in --out from its newest checkpoint (its config.toml is the base); "
         "a missing or empty --out is an error. --resume auto starts a fresh run there instead when there is "
         "nothing to resume (for preemptible job scripts)", show_default=False, nargs="?", const=True,
         type=_resume_value, metavar="auto")
    flag(g, "--config", "settings file; keys as the flags (batch-size or batch_size; switches take true or false, "
         "e.g. hsdp = true); flags override it",
         show_default=False, metavar="FILE.toml")
    flag(g, "--log", "also stream metrics.jsonl's records to these sinks (comma-separated): tensorboard, wandb "
         "(offline), mlflow (local files); each needs its extra, e.g. pip install 'gradzip[tensorboard]'",
         show_default=False, metavar="SINKS")
    flag(g, "--no-progress", "no progress bar", show_default=False, dest="progress", action="store_false")


class _Sharding(argparse.Action):
    """``--fsdp``/``--hsdp``: store the layout, and note each one given, so that the two together are
    an error (:func:`config_from_args`) rather than the last one winning."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.const)
        namespace._layouts = {*getattr(namespace, "_layouts", ()), self.const}


def _resume_value(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"takes no value, or 'auto' (start fresh when there is nothing to "
                                         f"resume), not {text!r}")
    return text


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Merge defaults < resumed run's config.toml < --config file < flags, strictly validated."""
    if len(getattr(args, "_layouts", ())) > 1:  # as gradzip simulate says it
        raise GradzipError("--fsdp and --hsdp are two layouts of the same model; give one (--hsdp --ranks-per-node K "
                           "shards inside nodes)")
    names = {f.name for f in fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    from_file: dict[str, Any] = {}
    if given.get("config"):
        from_file = load_toml(given["config"])
        TrainConfig.from_dict({k: v for k, v in from_file.items() if k != "config"}, source=given["config"])
    resume = given.get("resume", from_file.get("resume", False))
    out = given.get("out", from_file.get("out"))
    base: dict[str, Any] = {}
    if resume and out and (Path(out) / "config.toml").is_file():
        saved = Path(out) / "config.toml"
        base = load_toml(saved)
        TrainConfig.from_dict(base, source=str(saved))
    return TrainConfig.from_dict({**base, **from_file, **given})


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    FaultPlan.from_env()  # a bad GRADZIP_FAULT fails here, before any rank starts
    if cfg.real_backend and not os.environ.get(LAUNCH_MARKER) and not _under_launcher():
        return _spawn(cfg)
    summary = train(cfg)
    if "final_loss" in summary and not os.environ.get(LAUNCH_MARKER):  # spawned: the parent reports
        _print_summary(summary)
    return 0


def _under_launcher() -> bool:
    return detect_launcher_env().external


def _spawn(cfg: TrainConfig) -> int:
    """Start ``cfg.workers`` local ranks running this command, wait, report."""
    cfg.check_runtime()
    check_machine(cfg.sync_spec)  # what the sync mode needs of this machine, before any rank starts
    if cfg.sharding == "hsdp":  # the node size against the world size this command starts
        ranks_per_node(cfg.ranks_per_node, cfg.workers, from_launcher=False)
    cfg = cfg.replace(out=cfg.out or cfg.default_out())
    check_out_dir(cfg)  # refuse before any process starts; reads only
    build_data(cfg, Runtime(device=torch.device("cpu"), rank=0, num_workers=1))  # warm the data cache once
    env = {LAUNCH_MARKER: "1"}
    if "OMP_NUM_THREADS" not in os.environ:  # the run's count (resumed), or N processes share the free cores
        env["OMP_NUM_THREADS"] = str(cfg.threads or max(1, choose_threads()[0] // cfg.workers))
    with tempfile.TemporaryDirectory(prefix="gradzip-train-") as tmp:
        path = Path(tmp) / "config.toml"
        write_toml(cfg, path)  # the fully resolved config, so every rank runs exactly this
        argv = ["train", "--config", str(path)] + (["--resume"] if cfg.resume else []) + \
            (["auto"] if cfg.resume_auto else [])
        if cfg.stop_at is not None:  # per-invocation settings are not in config.toml
            argv += ["--stop-at", str(cfg.stop_at)]
        rc = _launch(cfg, argv, env)
    if rc == 0 and (Path(cfg.out) / "summary.json").is_file():
        _print_summary(json.loads((Path(cfg.out) / "summary.json").read_text()))
    elif rc != 0:
        sys.stderr.write(f"gradzip train: {cfg.workers} {cfg.backend} ranks: a rank failed (exit code {rc}); "
                         "see its message above\n")
    return rc


def _launch(cfg: TrainConfig, argv: list[str], env: dict[str, str]) -> int:
    """Start the ranks. The network-testbed hook: with ``--netem``, the testbed's launcher runs
    one rank per emulated host; otherwise local processes on this machine."""
    if cfg.netem:
        return int(launch_in_testbed(cfg, argv, env_extra=env))
    # No overall timeout: a run takes as long as it takes; each collective has cfg.timeout.
    return int(spawn_local(cfg.backend, cfg.workers, argv, env_extra=env))


def _print_summary(s: dict[str, Any]) -> None:
    def f(v: Any, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    inter = s.get("inter_bytes_per_step")
    between = f" ({inter:,.0f} between nodes)" if inter is not None and inter < (s.get("bytes_per_step") or 0) else ""
    ratio = ("nothing to compress with one worker" if s.get("compression_ratio") is None
             else f"compression {s['compression_ratio']:.1f}x")
    n_skip = s.get("skipped_steps") or 0
    skipped = f", {n_skip} step{'s' if n_skip != 1 else ''} skipped (non-finite gradients)" if n_skip else ""
    what = s.get("compressor")
    how = f" (exchange {s.get('exchange')}{', hierarchical' if s.get('hierarchical') else ''})" \
        if s.get("exchange") else ""
    if str(s.get("optimizer", "")).startswith("onebit-"):  # what is compressed is the momentum
        what, how = s.get("optimizer"), f" (momentum sent as {s.get('spec')} after warm-up)"
    elif s.get("optimizer") == "demo":  # DeMo: its local momentum's top DCT coefficients
        what, how = "demo", f" (momentum sent as {s.get('spec')})"
    elif what == "none" and str(s.get("spec") or "none").split(":")[0] != "none":  # a sync mode's own codec
        what = s.get("spec")
    if s.get("sync", "step") != "step":  # what is compressed is the pseudo-gradient of each sync
        how += f", {s.get('sync')}: {s.get('syncs')} syncs of {f(s.get('bytes_per_sync'), ',.0f')} bytes"
    print(f"gradzip train: {s.get('steps')} steps of {s.get('model')} with {what}{how} on "
          f"{s.get('workers')} {s.get('backend')} workers: loss {f(s.get('final_loss'), '.4f')}, "
          f"eval loss {f(s.get('final_eval_loss'), '.4f')}, {f(s.get('tokens_per_s'), ',.0f')} tokens/s "
          f"({s.get('clock')}), {f(s.get('bytes_per_step'), ',.0f')} bytes/step sent per rank{between}, "
          f"{ratio}{skipped} -> {s.get('out')}")
    if s.get("warning"):
        print(f"gradzip train: warning: {s['warning']}", file=sys.stderr)
