"""``gradzip finetune``: sequence classification on top of a pretrained BERT.

:func:`finetune` takes the encoder of a ``gradzip train`` run (its newest checkpoint, or ``step``)
or of an exported Hugging Face directory (``model.safetensors`` + ``config.json`` + tokenizer
files, as ``gradzip export`` writes), adds a classifier (dropout and a linear layer on the pooled
``[CLS]`` output, as HF's ``BertForSequenceClassification``) and trains both with the standard
recipe: AdamW (weight decay 0.01, none on biases and LayerNorm), linear warm-up over a fraction of
the steps then linear decay to 0, gradient clipping at norm 1, 5 epochs at a peak lr of 3e-4 by
default (small BERTs want more than BERT-base's 5e-5 over 3 epochs: docs/downstream.md measures it). ``init="random"``
trains the same architecture from BERT's random initialisation instead: the baseline. The data is
read by :mod:`gradzip.training.finetune_data`.

One process (backend ``sim``) trains alone; under torchrun/mpirun/srun with several ranks (backend
``gloo``) the ranks train data-parallel with torch's DDP over the default process group, which
gradzip's communicator sets up with a timeout on every collective. ``batch_size`` is the global
batch, split across the ranks; every rank evaluates the whole validation set (identical weights,
so identical numbers), only rank 0 writes, and at the end the ranks compare a digest of their
weights (:class:`TrainingError` if they differ).

Written to ``out`` (which must be new or empty): ``summary.json`` (accuracy, for two classes F1,
precision and recall of the second label, eval loss, the per-epoch history, example counts, the
labels in id order, the checkpoint used, init, settings, seconds), ``metrics.jsonl`` (one record
per epoch, also sent to the ``log`` sinks), ``predictions.jsonl`` (the label and the prediction
of every validation example, in file order) and, unless ``save_model`` is off, ``model/``: the
fine-tuned classifier as a Hugging Face ``BertForSequenceClassification`` directory
(:mod:`gradzip.training.finetune_save`). Bad input is a :class:`GradzipError` raised before
anything is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradzip.comm import Communicator, detect_launcher_env, init_communicator
from gradzip.data import WordPieceTokenizer
from gradzip.errors import GradzipError, TrainingError
from gradzip.io import atomic_write_text
from gradzip.models import BertConfig, BertForPreTraining
from gradzip.training import checkpoint, export
from gradzip.training.finetune_data import Encoded, classification_metrics, encode, label_names, read_examples
from gradzip.training.finetune_save import save_classifier
from gradzip.training.loggers import check_available, open_sinks, parse_log
from gradzip.training.metrics import write_summary
from gradzip.training.schedule import WarmupDecay

INITS = ("pretrained", "random")
BACKENDS = ("sim", "gloo")
EVAL_BATCH = 256
# HF ACT2FN names -> gradzip's (the inverse of the export's table, plus HF's other tanh GELU name)
_FROM_HF_ACT = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "relu": "relu"}
_HF_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


@dataclass
class FinetuneConfig:
    """Settings of :func:`finetune` (the flags of ``gradzip finetune``). ``checkpoint``: a run
    directory or an exported HF directory; ``train``/``validation``: files or ``hf:...`` names;
    ``warmup``: a fraction of the steps; ``backend``: None picks sim for one process, gloo for
    several ranks under a launcher."""

    checkpoint: str
    train: str
    validation: str
    out: str
    epochs: int = 5
    lr: float = 3e-4  # BERT-base's 5e-5 over 3 epochs leaves the small models gradzip trains at chance
    batch_size: int = 32
    warmup: float = 0.1
    seq_len: int = 128
    seed: int = 0
    weight_decay: float = 0.01
    dropout: float = 0.1
    init: str = "pretrained"
    step: int | None = None
    log: str | None = None
    backend: str | None = None
    timeout: float = 300.0
    save_model: bool = True

    def check(self) -> None:
        """Raise :class:`GradzipError` for a setting out of range (reads no file)."""
        for name in ("epochs", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise GradzipError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 3:
            raise GradzipError(f"--seq-len must be >= 3 ([CLS], a token, [SEP]), got {self.seq_len}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise GradzipError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.warmup <= 1:
            raise GradzipError(f"--warmup is a fraction of the steps, in [0, 1]; got {self.warmup}")
        if not 0 <= self.dropout < 1:
            raise GradzipError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not 0 <= self.weight_decay < 1:
            raise GradzipError(f"--weight-decay must be in [0, 1), got {self.weight_decay}")
        if self.init not in INITS:
            raise GradzipError(f"--init {self.init}: choose {' or '.join(INITS)}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise GradzipError(f"--backend {self.backend}: choose {' or '.join(BACKENDS)}")
        if self.step is not None and self.step < 0:
            raise GradzipError(f"--step must be >= 0, got {self.step}")
        if not self.timeout > 0:
            raise GradzipError(f"--timeout must be > 0 seconds, got {self.timeout}")


# ---------------------------------------------------------------------- the pretrained model
@dataclass
class Source:
    """A pretrained BERT: its config (dropout set for fine-tuning), weights (``bert.*`` keys, or
    bare encoder keys), tokenizer, and where it came from (``kind`` ``run`` or ``hf``)."""

    config: BertConfig
    weights: dict[str, Tensor]
    tokenizer: WordPieceTokenizer
    kind: str
    path: Path
    step: int | None


def load_source(path: str, step: int | None = None, dropout: float = 0.1) -> Source:
    """The model and tokenizer of a ``gradzip train`` run directory (the checkpoint of ``step``,
    default the newest; the tokenizer rebuilt as ``gradzip export`` does) or of a Hugging Face
    BERT directory (``config.json``, ``model.safetensors`` or ``pytorch_model.bin``, and
    ``tokenizer.json`` or ``vocab.txt``)."""
    d = Path(path)
    if (d / "config.toml").is_file() or checkpoint.list_checkpoints(d, 0):
        train_cfg = export._run_config(d)  # reused, so that both commands read a run the same way
        ckpt_step, ckpt = export.pick_checkpoint(d, step)
        weights = export.model_weights(checkpoint.read(ckpt, 0)["shared"], ckpt)
        cfg = export.model_config(train_cfg, weights, ckpt)
        tok = export.run_tokenizer(train_cfg, cfg.vocab_size)
        return Source(_with_dropout(cfg, dropout), weights, tok, "run", ckpt, ckpt_step)
    if (d / "config.json").is_file():
        if step is not None:
            raise GradzipError(f"--step {step}: {d} is an exported model with one set of weights; --step picks a "
                               "checkpoint of a run directory")
        return _hf_source(d, dropout)
    raise GradzipError(f"CHECKPOINT {d} is neither a gradzip run directory (config.toml, ckpt-*.pt) nor a Hugging "
                       "Face BERT directory (config.json, model.safetensors); give one of them")


def _with_dropout(cfg: BertConfig, dropout: float) -> BertConfig:
    return dataclasses.replace(cfg, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)


def _hf_source(d: Path, dropout: float) -> Source:
    try:
        hf = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise GradzipError(f"{d / 'config.json'} is not readable JSON ({e})") from None
    if hf.get("model_type") == "roberta-prelayernorm":
        raise GradzipError(f"{d} is an export of a --pre-ln run (roberta-prelayernorm); fine-tune from the run's "
                           "directory instead, which gradzip reads as it trained it")
    if hf.get("model_type", "bert") != "bert" or hf.get("position_embedding_type", "absolute") != "absolute":
        raise GradzipError(f"{d} holds a {hf.get('model_type')} model ({hf.get('position_embedding_type')} "
                           "positions); gradzip fine-tunes BERT with absolute position embeddings")
    act = _FROM_HF_ACT.get(hf.get("hidden_act", "gelu"))
    if act is None:
        raise GradzipError(f"{d}: hidden_act {hf.get('hidden_act')!r} is not one of {', '.join(_FROM_HF_ACT)}")
    fields = {f.name for f in dataclasses.fields(BertConfig)}
    cfg = BertConfig(**{**{k: v for k, v in hf.items() if k in fields}, "hidden_act": act})
    if (d / "model.safetensors").is_file():
        try:
            from safetensors.torch import load_file
        except ModuleNotFoundError:
            raise GradzipError(f"{d / 'model.safetensors'} needs safetensors: pip install \"gradzip[hf]\"") from None
        weights, path = load_file(d / "model.safetensors"), d / "model.safetensors"
    elif (d / "pytorch_model.bin").is_file():
        weights, path = torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True), \
            d / "pytorch_model.bin"
    else:
        raise GradzipError(f"{d} has a config.json but no model.safetensors or pytorch_model.bin")
    tok_file = next((d / n for n in ("tokenizer.json", "vocab.txt") if (d / n).is_file()), None)
    if tok_file is None:
        raise GradzipError(f"{d} has no tokenizer.json or vocab.txt; export the model with its tokenizer")
    tok = WordPieceTokenizer.from_file(tok_file)
    if tok.vocab_size > cfg.vocab_size:
        raise GradzipError(f"{tok_file} has {tok.vocab_size} tokens, more than the model's {cfg.vocab_size}")
    return Source(_with_dropout(cfg, dropout), weights, tok, "hf", path, None)


class SequenceClassifier(nn.Module):
    """BERT's encoder and a classifier on its pooled ``[CLS]`` output (dropout, then linear), with
    the parameter names of HF ``BertForSequenceClassification`` (``bert.*``, ``classifier.*``).
    ``forward(input_ids, token_type_ids, attention_mask)`` gives fp32 logits ``(batch, num_labels)``."""

    def __init__(self, cfg: BertConfig, num_labels: int) -> None:
        super().__init__()
        self.bert = BertForPreTraining(cfg).bert  # BERT's initialisation: N(0, 0.02), LayerNorm (1, 0)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.classifier = nn.Linear(cfg.hidden_size, num_labels)
        nn.init.normal_(self.classifier.weight, mean=0.0, std=cfg.initializer_range)
        nn.init.zeros_(self.classifier.bias)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, attention_mask: Tensor) -> Tensor:
        _, pooled = self.bert(input_ids, token_type_ids, attention_mask)
        return self.classifier(self.dropout(pooled)).float()


def build_model(source: Source, num_labels: int, init: str, seed: int) -> SequenceClassifier:
    """A :class:`SequenceClassifier` with the source's encoder weights (``init="pretrained"``) or
    BERT's random ones (``"random"``). Seeded first, so that the classifier (and the random
    encoder) is the same for every source of the same architecture."""
    torch.manual_seed(seed)
    model = SequenceClassifier(source.config, num_labels)
    if init == "random":
        return model
    bert = source.weights
    sd = {k[5:]: v for k, v in bert.items() if k.startswith("bert.")} if any(k.startswith("bert.") for k in bert) \
        else {k: v for k, v in bert.items() if not k.startswith(("cls.", "classifier."))}
    sd = {k: v for k, v in sd.items() if k not in _HF_BUFFERS}
    expected = {k: tuple(v.shape) for k, v in model.bert.state_dict().items()}
    wrong = sorted(set(expected) ^ set(sd))
    wrong += sorted(k for k in expected if k in sd and tuple(sd[k].shape) != expected[k])
    if wrong:
        raise GradzipError(f"{source.path}: the weights do not fit the BERT encoder of its config (keys or shapes "
                           f"differ: {', '.join(wrong[:3])})")
    model.bert.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return model


# ---------------------------------------------------------------------- fine-tuning
def check_out(out: Path) -> None:
    """Refuse an ``--out`` that exists and is not an empty directory (nothing is overwritten)."""
    if out.exists() and not out.is_dir():
        raise GradzipError(f"--out {out} exists and is not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()):
        raise GradzipError(f"--out {out} exists and is not empty; choose another --out")


def finetune(cfg: FinetuneConfig, echo: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Fine-tune as the module docstring says; returns the summary (on every rank; only rank 0
    writes it). ``echo`` receives one progress line per epoch on rank 0."""
    t0 = time.perf_counter()
    cfg.check()
    out = Path(cfg.out)
    check_out(out)
    sink_names = parse_log(cfg.log)
    check_available(sink_names)
    env = detect_launcher_env()
    backend = cfg.backend or ("gloo" if env.world_size > 1 else "sim")
    if backend == "sim" and env.world_size > 1:
        raise GradzipError(f"--backend sim runs one process, but the {env.launcher} environment has "
                           f"{env.world_size} ranks; use --backend gloo (or leave --backend out)")
    source = load_source(cfg.checkpoint, cfg.step, cfg.dropout)
    if cfg.seq_len > source.config.max_position_embeddings:
        raise GradzipError(f"--seq-len {cfg.seq_len} exceeds the model's {source.config.max_position_embeddings} "
                           "positions; use a shorter --seq-len")
    train_ex, val_ex = read_examples(cfg.train, "train"), read_examples(cfg.validation, "validation")
    names = label_names(train_ex, val_ex)
    train = encode(source.tokenizer, train_ex, names, cfg.seq_len)
    val = encode(source.tokenizer, val_ex, names, cfg.seq_len)
    world = env.world_size if backend == "gloo" else 1
    if len(train) < world or cfg.batch_size < world:
        raise GradzipError(f"{world} ranks need --batch-size and the training set ({len(train)} examples) to be at "
                           f"least {world}; got --batch-size {cfg.batch_size}")
    comm = init_communicator("gloo", cfg.timeout) if backend == "gloo" else None
    sinks: list[Any] = []
    try:
        rank = comm.rank if comm else 0
        model = build_model(source, len(names), cfg.init, cfg.seed)
        if rank == 0:
            checkpoint.make_out_dir(out)  # every rank checked it before the rendezvous: none created it
            sinks = open_sinks(sink_names, out, {**dataclasses.asdict(cfg), "backend": backend}, 0)
        run = _Run(cfg, model, train, val, comm, out if rank == 0 else None, sinks, echo if rank == 0 else None)
        history = run.train()
        preds, eval_loss = run.preds, run.eval_loss  # the last epoch's evaluation
        digest = run.digest()
        summary = _summary(cfg, source, names, train, val, history, preds, eval_loss, backend, world, digest,
                           time.perf_counter() - t0)
        summary["saved_model"] = "model" if cfg.save_model else None
        if rank == 0:
            if cfg.save_model:  # before summary.json, whose presence marks the run complete
                save_classifier(out / "model", model, source.config, source.tokenizer, names, summary)
            atomic_write_text(out / "predictions.jsonl", "".join(
                json.dumps({"label": names[int(y)], "prediction": names[int(p)]}) + "\n"
                for y, p in zip(val.labels, preds)))
            write_summary(out, summary)
        return summary
    finally:
        for s in sinks:
            s.close()
        if comm is not None:
            comm.close()


class _Run:
    """The training loop of one rank (see the module docstring)."""

    def __init__(self, cfg: FinetuneConfig, model: SequenceClassifier, train: Encoded, val: Encoded,
                 comm: Communicator | None, out: Path | None, sinks: list[Any],
                 echo: Callable[[str], None] | None) -> None:
        self.cfg, self.model, self.train_set, self.val, self.comm = cfg, model, train, val, comm
        self.out, self.sinks, self.echo = out, sinks, echo
        self.rank, self.world = (comm.rank, comm.world_size) if comm else (0, 1)
        if comm is not None:
            from torch.nn.parallel import DistributedDataParallel

            # Averages the gradients over the default group (set up by the communicator, with its timeout).
            self.net: nn.Module = DistributedDataParallel(model)
        else:
            self.net = model
        decay = [p for n, p in model.named_parameters() if not n.endswith("bias") and "LayerNorm" not in n]
        no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, eps=1e-8)
        self.steps_per_epoch = max(1, len(train) // cfg.batch_size)  # full global batches; all of a small set
        total = self.steps_per_epoch * cfg.epochs
        self.sched = WarmupDecay(self.opt, cfg.lr, round(cfg.warmup * total), total)
        torch.manual_seed(cfg.seed + 1 + self.rank)  # dropout: its own stream on each rank
        self.preds, self.eval_loss = torch.zeros(0, dtype=torch.long), math.nan

    def train(self) -> list[dict[str, Any]]:
        """Every epoch; returns the per-epoch records (also written to metrics.jsonl and the sinks)."""
        cfg, history, t0 = self.cfg, [], time.perf_counter()
        for epoch in range(1, cfg.epochs + 1):
            self.model.train()
            # The same permutation on every rank; rank r takes every world-th example of each batch.
            perm = torch.randperm(len(self.train_set), generator=torch.Generator().manual_seed(cfg.seed * 1009 + epoch))
            totals = torch.zeros(2, dtype=torch.float64)  # loss sum, examples
            for k in range(self.steps_per_epoch):
                batch_idx = perm[k * cfg.batch_size:(k + 1) * cfg.batch_size]
                b = self.train_set.batch(batch_idx[self.rank::self.world])
                logits = self.net(b["input_ids"], b["token_type_ids"], b["attention_mask"])
                loss_sum = F.cross_entropy(logits, b["labels"], reduction="sum")
                # DDP averages over ranks: scaled so that the result is the gradient of the global batch's mean
                (loss_sum * self.world / len(batch_idx)).backward()
                nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                lr = self.sched.lr
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad(set_to_none=True)
                totals += torch.tensor([float(loss_sum.detach()), len(b["labels"])], dtype=torch.float64)
            if self.comm is not None:
                totals = self.comm.allreduce(totals, "sum")
            preds, eval_loss = self.evaluate()
            self.preds, self.eval_loss = preds, eval_loss
            metrics = classification_metrics(preds, self.val.labels, int(self.model.classifier.out_features))
            rec = {"epoch": epoch, "step": epoch * self.steps_per_epoch, "loss": float(totals[0] / totals[1]),
                   "lr": lr, "eval_loss": eval_loss, **{f"eval_{k}": v for k, v in metrics.items()},
                   "seconds": round(time.perf_counter() - t0, 3)}
            history.append(rec)
            self._record(rec)
        return history

    def _record(self, rec: dict[str, Any]) -> None:
        if self.out is not None:
            with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as fh:
                fh.write(json.dumps(rec) + "\n")
        for s in self.sinks:
            s.log(rec)
        if self.echo is not None:
            f1 = f", f1 {rec['eval_f1']:.4f}" if "eval_f1" in rec else ""
            self.echo(f"epoch {rec['epoch']}/{self.cfg.epochs}: train loss {rec['loss']:.4f}, eval loss "
                      f"{rec['eval_loss']:.4f}, accuracy {rec['eval_accuracy']:.4f}{f1}")

    @torch.no_grad()
    def evaluate(self) -> tuple[Tensor, float]:
        """Predictions on the whole validation set, and the mean cross-entropy."""
        self.model.eval()
        preds, loss = [], 0.0
        for start in range(0, len(self.val), EVAL_BATCH):
            b = self.val.batch(torch.arange(start, min(start + EVAL_BATCH, len(self.val))))
            logits = self.model(b["input_ids"], b["token_type_ids"], b["attention_mask"])
            loss += float(F.cross_entropy(logits, b["labels"], reduction="sum"))
            preds.append(logits.argmax(-1))
        self.model.train()
        return torch.cat(preds), loss / len(self.val)

    def digest(self) -> str:
        """sha256 of the weights; with several ranks, checked to be the same on every one."""
        h = hashlib.sha256()
        for name, t in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        hexdigest = h.hexdigest()
        if self.comm is not None:
            mine = torch.tensor([int(hexdigest[:15], 16)], dtype=torch.int64)
            got = [int(t.item()) for t in self.comm.allgather(mine, same_shape=True)]
            if len(set(got)) > 1:
                bad = [r for r, g in enumerate(got) if g != got[0]]
                raise TrainingError(f"after fine-tuning the weights of rank(s) {bad} differ from rank 0's; the "
                                    "data-parallel replicas diverged")
        return hexdigest


def _summary(cfg: FinetuneConfig, source: Source, names: list[int | str], train: Encoded, val: Encoded,
             history: list[dict[str, Any]], preds: Tensor, eval_loss: float, backend: str, world: int,
             digest: str, seconds: float) -> dict[str, Any]:
    metrics = classification_metrics(preds, val.labels, len(names))
    c = source.config
    return {
        "task": "sequence-classification",
        **metrics,
        "eval_loss": eval_loss,
        "labels": names,
        **({"positive_label": names[1]} if len(names) == 2 else {}),
        "examples": {"train": len(train), "validation": len(val)},
        "truncated": {"train": train.truncated, "validation": val.truncated},
        "checkpoint": str(source.path),
        "checkpoint_kind": source.kind,
        "checkpoint_step": source.step,
        "init": cfg.init,
        "train": cfg.train,
        "validation": cfg.validation,
        "model": {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
                  "vocab_size": c.vocab_size},
        "settings": {k: getattr(cfg, k) for k in ("epochs", "lr", "batch_size", "warmup", "seq_len", "seed",
                                                 "weight_decay", "dropout")},
        "steps": history[-1]["step"] if history else 0,
        "history": history,
        "backend": backend,
        "workers": world,
        "weights_sha256": digest,
        "seconds": round(seconds, 3),
    }
