"""The typed configuration of one training run, shared by ``gradzip train`` and the sweep runner.

:class:`TrainConfig` has one field per ``gradzip train`` flag (``--batch-size`` is
``batch_size``; the switches ``--fsdp``/``--hsdp`` are the one field ``sharding``, and the keys
``fsdp = true``/``hsdp = true`` stand for it). Sources, later ones winning:

1. the field defaults below;
2. with ``--resume``, the ``config.toml`` saved in ``--out`` by the run being continued;
3. ``--config FILE.toml``: flat ``key = value`` lines, keys spelled as the flags (``batch-size``
   or ``batch_size``);
4. flags given on the command line.

:meth:`TrainConfig.from_dict` is strict: an unknown key, a value of the wrong type or out of range
raises :class:`~gradzip.errors.GradzipError` with a one-line message that says how to fix it.
:meth:`TrainConfig.to_dict` and :func:`write_toml` give back a dict / TOML file that
``from_dict`` / ``--config`` accept, so a run's ``config.toml`` reproduces it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import time
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from gradzip.compress.registry import create, normalize_spec, parse_spec
from gradzip.errors import GradzipError, SpecError
from gradzip.io import atomic_write_text
from gradzip.models import bert_config
from gradzip.optim.registry import OPTIMIZER_NAMES
from gradzip.plan.auto import is_auto
from gradzip.plan.sync import SyncSpec, mode_codec, parse_sync
from gradzip.training.config_checks import (
    FT_MODES,
    SWITCHES,
    _pre,
    check_auto,
    check_ft,
    check_generated,
    check_netem,
    check_sharding,
    sharding_switches,
)
from gradzip.training.loggers import check_available, parse_log
from gradzip.units import parse_bandwidth, parse_latency

BACKENDS = ("sim", "gloo", "nccl", "mpi")
OPTIMIZERS = OPTIMIZER_NAMES  # a live view of the registry (gradzip.optim.registry): built-ins and plug-ins
ONEBIT_SPEC = "onebit:exchange=twophase"  # what the 1-bit optimizers send, unless --compressor says otherwise
DEMO_SPEC = "demo:topk=32,chunk=64,decay=0.999"  # what --optimizer demo sends, unless --compressor demo:... says
DEMO_COMPRESSORS = ("demo", "distro")  # what --optimizer demo can send: DeMo's own, or DisTrO's wire as Psyche's
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")

# Fields that may change when a run is resumed: they do not change what the steps compute.
# (``steps`` may change to extend a run; the LR schedule then follows the new length.)
RESUME_MUTABLE = frozenset({
    "steps", "stop_at", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints",
    "timeout", "progress", "resume", "resume_auto", "config", "out", "netem", "netem_trace", "max_skips", "log",
})
# Fields not written to a run's config.toml: they describe one invocation, not the run (so that
# `--resume` after `--stop-at` does not stop again at the same step).
# Fields a rank may set differently from the others: they change no collective and no result.
# ``threads`` is per rank too: each rank's own count (under a launcher, from its own environment).
RANK_LOCAL = frozenset({"progress", "config", "timeout", "log", "threads"})
_NOT_SAVED = frozenset({"resume", "resume_auto", "config", "stop_at"})


@dataclass
class TrainConfig:
    """One ``gradzip train`` run. Field docs are the ``--help`` texts of the flags."""

    # -- what is trained, how it communicates
    model: str = "bert-tiny"
    pre_ln: bool = False  # pre-LayerNorm blocks (Hugging Face's RobertaPreLayerNorm), instead of BERT's post-LN
    compressor: str = "none"
    exchange: str | None = None  # the scheme (gradzip ls), instead of the spec's exchange=...
    sync: str = "step"  # step (every step), diloco:every=H,..., localsgd:every=H (gradzip.plan.sync)
    backend: str = "sim"
    workers: int = 4
    bandwidth: str = "1gbit"
    latency: str = "50us"
    hierarchical: bool = False  # reduce inside nodes, compress only across them
    sharding: str = "none"  # none (replicated, DDP-like), fsdp, hsdp (gradzip.training.sharding)
    ef_dtype: str = "fp32"  # --fsdp/--hsdp: the error memory's dtype, fp32 or bf16 (half the memory)
    intra_dtype: str = "native"  # hierarchical exchange, wire dtype inside a node: native (the gradient's), fp16, bf16
    ranks_per_node: int | None = None  # sim, local and testbed runs; else from the launcher
    intra_bandwidth: str = "100gbit"  # sim: the link inside a node
    intra_latency: str = "5us"
    # -- batch and length
    batch_size: int = 32
    accumulation: int = 1
    seq_len: int = 128
    steps: int = 100
    stop_at: int | None = None
    # -- optimisation
    lr: float = 1e-3
    warmup: float = 10
    optimizer: str = "adamw"
    weight_decay: float = 0.01
    momentum: float = 0.0  # --optimizer sgd (heavy-ball)
    precision: str = "fp32"
    clip: float = 1.0
    dropout: float = 0.1  # BERT's hidden and attention dropout
    init_std: float = 0.02  # standard deviation of the initial weights (BERT's initializer_range)
    seed: int = 0
    max_skips: int = 10  # consecutive steps skipped for a non-finite gradient before the run stops (0: never)
    freeze_step: float = 0.2  # onebit-adam/-lamb: warm-up steps (below 1: a fraction of --steps)
    # -- data
    corpus: str | None = None
    vocab_size: int | None = None
    tokenizer: str | None = None  # a vocab.txt or tokenizer.json to use instead of training one
    mask_prob: float = 0.15  # share of tokens masked in training batches (held-out batches: always 0.15)
    whole_word_masking: bool = False  # mask every piece of a chosen word (training batches; held-out: unchanged)
    # -- evaluation, checkpoints, outputs
    eval_every: int = 50
    eval_batches: int = 16
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    out: str | None = None
    resume: bool = False
    resume_auto: bool = False  # --resume auto: start fresh when there is nothing to resume
    config: str | None = None
    progress: bool = True
    log: str | None = None  # live-curve sinks beside metrics.jsonl: tensorboard, wandb, mlflow (comma-separated)
    # -- engine and backends
    bucket_cap_mb: float = 25.0
    min_compress_numel: int = 1024
    timeout: float = 300.0
    device: str = "auto"
    # torch's intra-op threads. Unset: OMP_NUM_THREADS, else the cores free at start-up; the run's
    # config.toml records the count used, so that --resume computes with the same (bit-identical sums).
    threads: int | None = None
    netem: str | None = None
    netem_trace: str | None = None  # --netem: a trace file (or shipped trace name) played on the testbed

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "") -> TrainConfig:
        """Strictly validated config from ``d`` (keys with ``-`` or ``_``); missing keys keep defaults.

        ``source`` names where ``d`` came from in error messages (e.g. the TOML file).
        """
        kwargs = {}
        for raw_key, value in sharding_switches(d, source).items():
            key = _field_name(raw_key, source)
            if key == "resume" and value == "auto":  # --resume auto, or resume = "auto" in a file
                value, kwargs["resume_auto"] = True, True
            if key in kwargs:
                raise GradzipError(f"{_pre(source)}key {raw_key!r} given twice (as {key!r})")
            kwargs[key] = _check_type(key, value, source)
        _normalize_names(kwargs)
        cfg = cls(**kwargs)
        cfg.validate(source)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """Every field, as ``from_dict`` accepts it."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> TrainConfig:
        """A validated copy with ``changes`` applied (same rules as ``from_dict``)."""
        return TrainConfig.from_dict({**self.to_dict(), **changes}, source="")

    # ------------------------------------------------------------------ validation
    def validate(self, source: str = "") -> None:
        """Static checks (no hardware look-ups; see :meth:`check_runtime` for those)."""

        def bad(key: str, why: str) -> GradzipError:
            return GradzipError(f"{_pre(source)}{_flag(key)} {why}")

        for key in ("workers", "batch_size", "accumulation", "seq_len", "steps", "keep_checkpoints"):
            if getattr(self, key) < 1:
                raise bad(key, f"must be >= 1, got {getattr(self, key)}")
        for key in ("eval_every", "eval_batches", "checkpoint_every", "min_compress_numel", "seed", "max_skips"):
            if getattr(self, key) < 0:
                raise bad(key, f"must be >= 0, got {getattr(self, key)}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise bad("stop_at", f"must be between 1 and --steps ({self.steps}), got {self.stop_at}")
        for key in ("lr", "bucket_cap_mb", "timeout"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v > 0):
                raise bad(key, f"must be a positive number, got {v}")
        for key in ("clip", "weight_decay"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v >= 0):
                raise bad(key, f"must be >= 0 (0 turns it off), got {v}")
        if not (math.isfinite(self.init_std) and self.init_std > 0):
            raise bad("init_std", f"must be a positive number (BERT: 0.02), got {self.init_std}")
        if not (math.isfinite(self.dropout) and 0 <= self.dropout < 1):
            raise bad("dropout", f"must be in [0, 1), got {self.dropout}")
        if not (math.isfinite(self.mask_prob) and 0 < self.mask_prob < 1):
            raise bad("mask_prob", f"must be in (0, 1), e.g. 0.15 (BERT) or 0.4, got {self.mask_prob}")
        if not (math.isfinite(self.warmup) and self.warmup >= 0):
            raise bad("warmup", f"must be >= 0 (steps, or a fraction of --steps below 1), got {self.warmup}")
        if self.warmup >= 1 and self.warmup != int(self.warmup):
            raise bad("warmup", f"must be a whole number of steps or a fraction below 1, got {self.warmup}")
        if not (math.isfinite(self.freeze_step) and self.freeze_step > 0) or \
                (self.freeze_step >= 1 and self.freeze_step != int(self.freeze_step)):
            raise bad("freeze_step", f"must be a whole number of steps >= 1 or a fraction in (0, 1), got "
                      f"{self.freeze_step}")
        for key, choices in (("backend", BACKENDS), ("optimizer", OPTIMIZERS),
                             ("precision", PRECISIONS), ("device", DEVICES)):
            if getattr(self, key) not in choices:
                raise bad(key, f"must be one of {', '.join(choices)}, got {getattr(self, key)!r}")
        if self.threads is not None and self.threads < 1:
            raise GradzipError(f"{_pre(source)}threads must be >= 1 (or unset: OMP_NUM_THREADS, else the free cores), "
                               f"got {self.threads}")
        if self.vocab_size is not None and self.vocab_size < 100:
            raise bad("vocab_size", f"must be >= 100 (or unset for the model's default), got {self.vocab_size}")
        check_generated(self, source)
        if self.seq_len > 512:
            raise bad("seq_len", f"must be <= 512 (BERT's position embeddings), got {self.seq_len}")
        if self.intra_dtype not in ("native", "fp16", "bf16"):
            raise bad("intra_dtype", f"must be native (the gradient's own dtype), fp16 or bf16, got "
                      f"{self.intra_dtype!r}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise bad("ranks_per_node", f"must be >= 1, got {self.ranks_per_node}")
        if self.backend == "sim" and self.ranks_per_node and self.workers % self.ranks_per_node:
            raise bad("ranks_per_node", f"{self.ranks_per_node} does not divide --workers {self.workers}: every node "
                      "holds the same number of workers")
        try:
            parse_latency(self.latency)
            parse_bandwidth(self.intra_bandwidth)
            parse_latency(self.intra_latency)
        except SpecError as e:
            raise GradzipError(f"{_pre(source)}{e}") from None
        check_netem(self, source)  # --bandwidth (or unshaped), --netem, --netem-trace
        try:
            parse_log(self.log)
        except GradzipError as e:
            raise GradzipError(f"{_pre(source)}{e}") from None
        if not (math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            raise bad("momentum", f"must be in [0, 1), got {self.momentum}")
        self._check_sync(source), self._check_names(source), check_sharding(self, source)
        demo_spec = parse_spec(self.spec)[0] in DEMO_COMPRESSORS
        if self.optimizer == "demo" and not demo_spec:
            raise GradzipError(f"{_pre(source)}--optimizer demo needs the demo compressor or distro (DeMo sends its "
                               f"momentum's top DCT coefficients), not --compressor {self.compressor}; leave "
                               f"--compressor out ({DEMO_SPEC}) or give demo:... or distro:...")
        if demo_spec and self.optimizer != "demo":
            raise GradzipError(f"{_pre(source)}--compressor {self.compressor} needs --optimizer demo (its sign step "
                               f"on the decoded momentum is what makes it DeMo), not --optimizer {self.optimizer}")

    @property
    def sync_spec(self) -> SyncSpec:
        """``--sync`` parsed (validated by :meth:`validate`)."""
        return _parse_sync(self.sync)

    def _check_sync(self, source: str) -> None:
        try:
            sync = _parse_sync(self.sync)
            _check_own_codec(self, sync)
            if sync.mode in FT_MODES:  # torchft's settings, checked before any rank starts
                check_ft(self, source)
        except SpecError as e:
            raise GradzipError(f"{_pre(source)}{e}") from None
        if sync.outer and (self.optimizer.startswith("onebit-") or self.optimizer == "demo"):
            raise GradzipError(f"{_pre(source)}--sync {sync.mode} takes an inner optimizer that steps on local "
                               f"gradients (adamw, lamb, sgd), not --optimizer {self.optimizer}, which exchanges "
                               "every step itself")

    @property
    def spec(self) -> str:
        """The compressor spec with ``exchange`` applied: what the engine is given. The 1-bit
        optimizers send the momentum with ``onebit:exchange=twophase`` unless told otherwise."""
        comp = self.compressor
        if comp == "none" and self.optimizer.startswith("onebit-"):  # --exchange, if given, replaces twophase
            comp = ONEBIT_SPEC if self.exchange is None else "onebit"
        elif comp == "none" and self.optimizer == "demo":
            comp = DEMO_SPEC
        if self.exchange is None:
            return comp
        _, params = parse_spec(comp)
        if params.get("exchange", self.exchange).lower() != self.exchange.lower():
            raise GradzipError(f"--exchange {self.exchange} and --compressor {comp} disagree; "
                               "set the scheme in one place")
        if "exchange" in params:
            return comp
        return f"{comp}{',' if ':' in comp else ':'}exchange={self.exchange}"

    def _check_names(self, source: str) -> None:
        """The model and compressor names are known ."""
        if is_auto(self.compressor):
            check_auto(self, source)
            return
        try:
            create(self.spec)
        except SpecError as e:
            flag = "--exchange" if self.exchange is not None and "exchange" in str(e) else "--compressor"
            raise GradzipError(f"{_pre(source)}{flag}: {e}") from None
        try:
            bert_config(self.model)
        except (GradzipError, KeyError, ValueError) as e:
            raise GradzipError(f"{_pre(source)}--model: {e}") from None

    def check_runtime(self) -> None:
        """Checks that depend on this machine: CUDA for nccl and fp16, the loggers' packages. What a
        sync mode needs of the machine (``--sync ftdiloco``: torchft, its Lighthouse) is checked by
        :func:`gradzip.training.runtime.create_runtime`, before the run's world starts."""
        cuda = torch.cuda.is_available()
        if self.device == "cuda" and not cuda:
            raise GradzipError("--device cuda: no CUDA device is available here; use --device cpu")
        if self.backend == "nccl" and not cuda:
            raise GradzipError("--backend nccl needs CUDA GPUs; on CPU use --backend gloo or mpi")
        if self.backend == "nccl" and self.device == "cpu":
            raise GradzipError("--backend nccl needs --device cuda (or auto)")
        if self.precision == "fp16" and self.resolved_device != "cuda":
            raise GradzipError("--precision fp16 needs a CUDA device (gradient scaling); on CPU use bf16 or fp32")
        check_available(parse_log(self.log))

    # ------------------------------------------------------------------ derived values
    @property
    def warmup_steps(self) -> int:
        """``warmup`` in steps: a value below 1 is a fraction of ``steps``; at most ``steps``."""
        if 0 < self.warmup < 1:
            return int(round(self.warmup * self.steps))
        return min(int(self.warmup), self.steps)

    @property
    def freeze_steps(self) -> int:
        """``freeze_step`` in steps: a value below 1 is a fraction of ``steps`` (at least 1)."""
        if self.freeze_step < 1:
            return max(1, int(round(self.freeze_step * self.steps)))
        return int(self.freeze_step)

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def real_backend(self) -> bool:
        return self.backend != "sim"

    def default_out(self) -> str:
        """``runs/<model>-<compressor>-<backend><workers>-<date-time>``."""
        comp = re.sub(r"[^A-Za-z0-9.=]+", "_", self.compressor).strip("_")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return os.path.join("runs", f"{self.model}-{comp}-{self.backend}{self.workers}-{stamp}")

    def agreement(self) -> dict[str, Any]:
        """The settings every rank of a run must share (compared at start-up by the engine): all of
        them but the ones that only steer this process's output."""
        return {k: v for k, v in self.to_dict().items() if k not in RANK_LOCAL}

    def diff(self, other: TrainConfig, ignore: frozenset[str] = RESUME_MUTABLE) -> list[str]:
        """``["--flag: a != b", ...]`` for fields that differ, except ``ignore``. ``threads`` unset on
        either side is no difference (the run's recorded count applies)."""
        out = []
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "threads" and None in (a, b):  # unset: the run's own count applies
                continue
            if f.name not in ignore and a != b:
                out.append(f"{_flag(f.name)} {a!r} vs {b!r}")
        return out


# ---------------------------------------------------------------------- TOML in and out
def load_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The flat table of a config file, keys normalised to field names. Errors are one line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GradzipError(f"config file {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GradzipError(f"cannot read config file {str(p)!r}: {e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise GradzipError(f"{p}: not valid TOML: {e}") from None
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            raise GradzipError(f"{p}: [{key}] tables are not allowed: use flat `key = value` lines as the flags")
        name = key.strip().replace("-", "_").lower()
        name = name if name in SWITCHES else _field_name(key, str(p))
        if name in out:  # `batch_size` and `batch-size`: one setting, written twice
            raise GradzipError(f"{p}: {spelled[name]!r} and {key!r} are the same setting; keep one of them")
        out[name], spelled[name] = value, key
    return sharding_switches(out, str(p))  # fsdp = true: the file's own layout, before flags override it


def write_toml(cfg: TrainConfig, path: str | os.PathLike[str]) -> None:
    """Write ``cfg`` as flat TOML (``None`` fields omitted), atomically."""
    lines = ["# gradzip train: resolved configuration (usable with --config)"]
    for key, value in cfg.to_dict().items():
        if value is None or key in _NOT_SAVED:
            continue
        lines.append(f"{key} = {_toml_value(value)}")
    atomic_write_text(path, "\n".join(lines) + "\n")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # always with a point or exponent, so the file states the type
    if isinstance(v, str):
        escaped = v.replace("\\", "\\\\").replace('"', '\\"')
        escaped = "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in escaped)
        return f'"{escaped}"'
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


# ---------------------------------------------------------------------- helpers
_FIELDS = {f.name: f for f in fields(TrainConfig)}
_TYPES: dict[str, tuple[type, bool]] = {}  # name -> (base type, optional)
for _f in fields(TrainConfig):
    _t = str(_f.type)
    _TYPES[_f.name] = ({"int": int, "float": float, "str": str, "bool": bool}[_t.split(" |")[0]], "None" in _t)


def _normalize_names(kwargs: dict[str, Any]) -> None:
    """Names in their registered spelling (``topK`` → ``topk``, ``FP16`` → ``fp16``), so configs,
    labels and run names echo one spelling; a spec that does not parse is left for validation."""
    if isinstance(kwargs.get("compressor"), str):
        try:
            kwargs["compressor"] = normalize_spec(kwargs["compressor"])
        except SpecError:
            pass
    for key in ("exchange", "model", "optimizer", "backend", "precision", "device"):
        if isinstance(kwargs.get(key), str):
            kwargs[key] = kwargs[key].strip().lower()


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _field_name(raw: str, source: str) -> str:
    key = str(raw).strip().replace("-", "_").lower()
    if key not in _FIELDS:
        names = [f.replace("_", "-") for f in _FIELDS] + list(SWITCHES)
        near = difflib.get_close_matches(key.replace("_", "-"), names, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else f"; valid keys: {', '.join(names)}"
        raise GradzipError(f"{_pre(source)}unknown key {raw!r}{hint}")
    return key


def _check_type(key: str, value: Any, source: str) -> Any:
    typ, optional = _TYPES[key]
    if value is None:
        if optional:
            return None
        raise GradzipError(f"{_pre(source)}{key} must be {_a(typ)}, got nothing")
    ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise GradzipError(f"{_pre(source)}{key} must be {_a(typ)}, got {value!r} ({type(value).__name__})")
    return value


def _a(typ: type) -> str:
    return {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}[typ.__name__]


def _parse_sync(text: str) -> SyncSpec:
    """``--sync`` parsed, once every sync mode of :mod:`gradzip.engine` has registered its spelling
    (a mode in its own file registers at import)."""
    from gradzip.engine.modes import load_modes

    load_modes()
    return parse_sync(text)


def _check_own_codec(cfg: TrainConfig, sync: SyncSpec) -> None:
    """A mode that sends its own codec (``--sync sparseloco``: :func:`gradzip.plan.sync.mode_codec`)
    would silently replace ``--compressor`` (or ``--exchange``): refused, as is a bad codec option."""
    try:
        codec = mode_codec(sync)
        if codec is None:
            return
        if cfg.compressor != "none" or cfg.exchange is not None:
            given = f"--compressor {cfg.compressor}" if cfg.compressor != "none" else f"--exchange {cfg.exchange}"
            raise SpecError(f"--sync {sync.mode} sends its own codec ({codec}): drop {given} and set the codec's "
                            f"options in --sync (gradzip ls lists them)")
        create(codec)
    except SpecError as e:  # the codec's own message, said of --sync
        raise SpecError(str(e) if str(e).startswith("--sync") else f"--sync {e}") from None
