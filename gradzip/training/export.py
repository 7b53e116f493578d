"""``gradzip export RUN_DIR --to hf OUT_DIR``: a run's checkpoint as a Hugging Face model directory.

:func:`export_hf` writes a directory that ``transformers.BertForPreTraining.from_pretrained`` and
``BertForMaskedLM.from_pretrained`` load unchanged (a ``--pre-ln`` run's:
``RobertaPreLayerNormForMaskedLM``, see :func:`hf_weights`), and that
``BertTokenizerFast.from_pretrained`` (or ``AutoTokenizer``) reads into a tokenizer giving the ids
gradzip gave during training:

- ``config.json``: gradzip's :class:`~gradzip.models.BertConfig` under HF ``BertConfig`` names;
- ``model.safetensors``: the model state dict of the checkpoint (rank 0's file holds the full one,
  also for ``--fsdp``/``--hsdp`` runs), without the tied aliases ``cls.predictions.decoder.weight``
  and ``.bias``: HF ties them to the word embeddings and ``cls.predictions.bias`` on load, as for
  its own checkpoints;
- ``vocab.txt``, ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``: the
  run's WordPiece tokenizer (``--tokenizer`` or the one trained on ``--corpus``, from the gradzip
  cache), with its lowercasing/accent rules and special tokens;
- ``README.md``: a model card with the run's compressor, steps, tokens, bytes and final losses
  (from ``summary.json``, and ``metrics.jsonl`` for the exported step).

Bad input (no checkpoint in the run directory, no checkpoint at ``--step``, an ``OUT_DIR`` that
exists and is not an empty directory, a tokenizer that no longer matches the model) raises
:class:`~gradzip.errors.GradzipError` before anything is written. The files are written into a
temporary sibling directory that is renamed to ``OUT_DIR`` at the end, so a failure leaves no
partial export. The exporter needs ``safetensors`` (the ``hf`` extra), not ``transformers``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from gradzip.data import WordPieceTokenizer, get_tokenizer, load_corpus
from gradzip.data.generated import is_generated, word_tokenizer
from gradzip.data.hmm import HMMSpec
from gradzip.errors import GradzipError
from gradzip.io import read_jsonl
from gradzip.models import BertConfig, bert_config, parameter_shapes
from gradzip.training import checkpoint
from gradzip.training.config import TrainConfig, load_toml

FORMATS = ("hf",)
# gradzip's activation names -> HF's ACT2FN names (same functions)
_HF_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
# alias -> owner: the tied parameters that appear twice in a state dict (see gradzip.models.bert)
_TIED = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
         "cls.predictions.decoder.bias": "cls.predictions.bias"}
_HF_INSTALL = 'pip install "gradzip[hf]"'


def export_hf(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], step: int | None = None) -> Path:
    """Export checkpoint ``step`` (default: the newest) of the run in ``run_dir`` to ``out_dir`` as
    a Hugging Face BERT directory (see the module docstring); returns ``out_dir``.

    ``out_dir`` must not exist or be an empty directory; its parent is created if needed. Every
    check runs before the first write, and the files appear together (one rename) or not at all.
    """
    run, out = Path(run_dir), Path(out_dir)
    check_out_dir(out)
    ckpt_step, ckpt_path = pick_checkpoint(run, step)
    save_file = _safetensors_save()
    train_cfg = _run_config(run)
    weights = model_weights(checkpoint.read(ckpt_path, 0)["shared"], ckpt_path)
    cfg = model_config(train_cfg, weights, ckpt_path)
    tok = run_tokenizer(train_cfg, cfg.vocab_size)
    weights = hf_weights(cfg, weights)
    files = {
        "config.json": json.dumps(hf_config(cfg, weights), indent=2) + "\n",
        **tokenizer_files(tok, cfg.max_position_embeddings),
        "README.md": model_card(run, out, ckpt_step, cfg, _summary(run), _step_record(run, ckpt_step), train_cfg),
    }

    def write(tmp: Path) -> None:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        # "format": "pt" is what from_pretrained checks before it reads a safetensors file
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return _write_dir(out, write)


def _safetensors_save() -> Any:
    """``safetensors.torch.save_file``, or a one-line error naming the extra that brings it."""
    try:
        from safetensors.torch import save_file
    except ModuleNotFoundError:
        raise GradzipError(f"exporting to hf needs safetensors, which is not installed: {_HF_INSTALL}") from None
    return save_file


# ---------------------------------------------------------------------- checks (read only)
def check_out_dir(out: Path) -> None:
    """Refuse an ``OUT_DIR`` that exists and is not an empty directory (nothing is overwritten)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise GradzipError(f"{out} exists and is not a directory; choose a new OUT_DIR")
    if out.is_dir() and any(out.iterdir()):
        raise GradzipError(f"{out} exists and is not empty; choose a new OUT_DIR or remove that one first")


def pick_checkpoint(run: Path, step: int | None) -> tuple[int, Path]:
    """``(step, path)`` of the rank-0 checkpoint file to export: ``step``'s, or the newest."""
    if not run.is_dir():
        raise GradzipError(f"run directory {run} does not exist; give the --out directory of a gradzip train run")
    found = checkpoint.list_checkpoints(run, 0)
    if not found:
        raise GradzipError(f"{run} holds no checkpoint (ckpt-*.pt); train with --checkpoint-every N "
                           "(a run writes one at its last step) or give another run directory")
    if step is None:
        return found[-1]
    for s, path in found:
        if s == step:
            return s, path
    steps = ", ".join(str(s) for s, _ in found)
    raise GradzipError(f"{run} has no checkpoint of step {step}; its checkpoints are of step(s) {steps}")


def _run_config(run: Path) -> TrainConfig:
    path = run / "config.toml"
    if not path.is_file():
        raise GradzipError(f"{run} has no config.toml, so its corpus and tokenizer are unknown; "
                           "give the directory of a gradzip train run")
    return TrainConfig.from_dict(load_toml(path), source=str(path))


def _summary(run: Path) -> dict[str, Any] | None:
    path = run / "summary.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # a run stopped before its end has checkpoints but no summary
        return None
    return summary if isinstance(summary, dict) else None


def _step_record(run: Path, step: int) -> dict[str, Any] | None:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [r for r in read_jsonl(path) if isinstance(r, dict) and r.get("step") == step]
    return records[-1] if records else None


# ---------------------------------------------------------------------- the model
def model_weights(shared: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's model state dict as safetensors can store it: tied aliases dropped (HF ties
    them again on load), every tensor contiguous and on the CPU."""
    sd = shared.get("model")
    if not isinstance(sd, dict) or not sd:
        raise GradzipError(f"checkpoint {path} holds no model state; export a checkpoint written by gradzip train")
    sd = dict(sd)
    for alias, owner in _TIED.items():
        if alias not in sd:
            continue
        tied = sd.pop(alias)
        if owner not in sd:  # only the alias was saved: it is the parameter
            sd[owner] = tied
        elif not torch.equal(sd[owner], tied):
            raise GradzipError(f"checkpoint {path}: {alias} differs from {owner}, but BERT ties them; "
                               "this is not a checkpoint of gradzip's BertForPreTraining")
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def model_config(train_cfg: TrainConfig, weights: dict[str, torch.Tensor], path: Path) -> BertConfig:
    """The run's :class:`BertConfig`: the model size of ``--model``, with the vocabulary and the
    number of positions read from the weights (the training loop sizes them from the data), and
    checked against every weight's shape."""
    try:
        vocab, positions = (int(weights[f"bert.embeddings.{n}_embeddings.weight"].shape[0])
                            for n in ("word", "position"))
    except KeyError as e:
        raise GradzipError(f"checkpoint {path} lacks {e.args[0]}; it is not a gradzip BERT checkpoint") from None
    cfg = bert_config(train_cfg.model, vocab_size=vocab, max_position_embeddings=positions,
                      hidden_dropout_prob=train_cfg.dropout, attention_probs_dropout_prob=train_cfg.dropout,
                      initializer_range=train_cfg.init_std, pre_layer_norm=train_cfg.pre_ln)
    expected = {k: s for k, s in parameter_shapes(cfg).items() if k not in _TIED}
    got = {k: tuple(v.shape) for k, v in weights.items()}
    wrong = sorted(set(expected) ^ set(got)) + sorted(k for k in expected if k in got and got[k] != expected[k])
    if wrong:
        raise GradzipError(f"checkpoint {path} does not fit --model {train_cfg.model} of its config.toml "
                           f"(keys or shapes differ: {', '.join(wrong[:3])}); export the run it came from")
    return cfg


def hf_weights(cfg: BertConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights under the names of the HF model the export is: BERT's are gradzip's own; a pre-LN
    model's are ``RobertaPreLayerNormForMaskedLM``'s (``bert.`` → ``roberta_prelayernorm.``, the MLM
    transform and bias → ``lm_head.``). RoBERTa numbers positions from ``pad_token_id + 1`` (padding
    sits at ``pad_token_id``), so the position table moves down by that many rows, which are zeros:
    a right-padded input then sees the positions it was trained with. The next-sentence head has no
    place in RobertaPreLayerNorm and is left out; the pooler stays (``RobertaPreLayerNormModel``'s)."""
    if not cfg.pre_layer_norm:
        return weights
    out: dict[str, torch.Tensor] = {}
    for k, v in weights.items():
        if k.startswith("cls.seq_relationship."):
            continue
        if k == "bert.embeddings.position_embeddings.weight":
            v = torch.cat([v.new_zeros(cfg.pad_token_id + 1, v.shape[1]), v])
        for ours, theirs in _PRE_LN_NAMES:
            if k.startswith(ours):
                k = theirs + k[len(ours):]
                break
        out[k] = v
    return out


# gradzip's names -> RobertaPreLayerNormForMaskedLM's (the first prefix that matches)
_PRE_LN_NAMES = (("bert.", "roberta_prelayernorm."), ("cls.predictions.transform.LayerNorm.", "lm_head.layer_norm."),
                 ("cls.predictions.transform.", "lm_head."), ("cls.predictions.bias", "lm_head.bias"))
_WORDS = {False: "bert.embeddings.word_embeddings.weight",
          True: "roberta_prelayernorm.embeddings.word_embeddings.weight"}


def hf_config(cfg: BertConfig, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``config.json`` for HF ``BertConfig``: gradzip's field names are HF's, plus the keys that
    ``AutoModel`` and the tied decoder need. A pre-LN model's is a ``RobertaPreLayerNormConfig``
    for the weights of :func:`hf_weights` (its position table ``pad_token_id + 1`` rows longer)."""
    fields = dataclasses.asdict(cfg)
    del fields["pre_layer_norm"]  # gradzip's switch; the model type says it
    fields["hidden_act"] = _HF_ACT[cfg.hidden_act]
    dtype = str(weights[_WORDS[cfg.pre_layer_norm]].dtype).removeprefix("torch.")
    if cfg.pre_layer_norm:
        if cfg.hidden_act != "gelu":  # RoBERTa's MLM head applies the exact GELU, whatever hidden_act says
            raise GradzipError(f"a pre-LN model with hidden_act {cfg.hidden_act} has no RobertaPreLayerNorm "
                               "counterpart (its MLM head is fixed to gelu); only gelu models export")
        fields["max_position_embeddings"] = cfg.max_position_embeddings + cfg.pad_token_id + 1
        return {"architectures": ["RobertaPreLayerNormForMaskedLM"], "model_type": "roberta-prelayernorm", **fields,
                "position_embedding_type": "absolute", "tie_word_embeddings": True, "classifier_dropout": None,
                "use_cache": True, "dtype": dtype}
    return {
        "architectures": ["BertForPreTraining"],
        "model_type": "bert",
        **fields,
        "position_embedding_type": "absolute",  # gradzip adds learnt absolute position embeddings
        "tie_word_embeddings": True,
        "classifier_dropout": None,
        "use_cache": True,
        "dtype": dtype,
    }


# ---------------------------------------------------------------------- the tokenizer
def run_tokenizer(train_cfg: TrainConfig, vocab_size: int) -> WordPieceTokenizer:
    """The tokenizer the run trained with: its ``--tokenizer`` file, or the WordPiece vocabulary
    learnt on its ``--corpus`` (cached; relearnt, deterministically, if the cache is gone)."""
    try:
        if train_cfg.tokenizer:
            tok = WordPieceTokenizer.from_file(train_cfg.tokenizer)
        elif is_generated(train_cfg.corpus):  # the calibrated tier's words w0, w1, ...
            tok = word_tokenizer(HMMSpec.parse(str(train_cfg.corpus)).words)
        else:
            asked = train_cfg.vocab_size or bert_config(train_cfg.model).vocab_size  # as the training runtime asks
            tok = get_tokenizer(load_corpus(train_cfg.corpus, progress=False), vocab_size=asked, progress=False)
    except GradzipError as e:
        raise GradzipError(f"the run's tokenizer cannot be rebuilt ({e}); run gradzip export where the run's "
                           "corpus/tokenizer paths resolve (relative ones: the directory it was trained in)") from None
    if tok.vocab_size != vocab_size:
        raise GradzipError(f"the run's tokenizer ({tok.source}) has {tok.vocab_size} tokens, its model {vocab_size}; "
                           "the corpus or tokenizer file changed since training, restore it to export this run")
    return tok


def tokenizer_files(tok: WordPieceTokenizer, max_length: int) -> dict[str, str]:
    """``vocab.txt``, ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
    of ``tok``. ``BertTokenizerFast`` rebuilds its pipeline from ``vocab.txt`` and the config's
    ``do_lower_case``/``strip_accents``/``tokenize_chinese_chars`` (transformers 5) or loads
    ``tokenizer.json`` and checks them (4.x): both give gradzip's ids, special tokens included."""
    spec = json.loads(tok.tokenizer.to_str())
    norm, pre, model = spec.get("normalizer") or {}, spec.get("pre_tokenizer") or {}, spec.get("model") or {}
    if (norm.get("type"), pre.get("type"), model.get("type")) != ("BertNormalizer", "BertPreTokenizer", "WordPiece") \
            or model.get("continuing_subword_prefix") != "##" or model.get("unk_token") != "[UNK]":
        raise GradzipError(f"the run's tokenizer {tok.source} is not a BERT WordPiece pipeline (BertNormalizer, "
                           "BertPreTokenizer, WordPiece with ##), so BertTokenizerFast cannot reproduce it")
    vocab = tok.tokenizer.get_vocab(with_added_tokens=True)
    ordered = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in ordered] != list(range(len(ordered))) or any("\n" in t for t in ordered):
        raise GradzipError(f"the vocabulary of {tok.source} has gaps in its ids or tokens with line breaks; "
                           "it cannot be written as a vocab.txt")
    special = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
               "mask_token": "[MASK]"}
    config = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": bool(norm.get("lowercase", True)),
        "strip_accents": norm.get("strip_accents"),
        "tokenize_chinese_chars": bool(norm.get("handle_chinese_chars", True)),
        "clean_up_tokenization_spaces": True,
        "model_max_length": int(max_length),
        **special,
    }
    return {
        "vocab.txt": "".join(t + "\n" for t in ordered),
        "tokenizer.json": tok.tokenizer.to_str(pretty=True),
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(special, indent=2) + "\n",
    }


# ---------------------------------------------------------------------- the model card
_PRE_LN_NOTE = " with pre-LN blocks (Hugging Face's RobertaPreLayerNorm)"
def _num(v: Any, fmt: str = ",") -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return "not recorded"
    return format(v, fmt)


def model_card(run: Path, out: Path, step: int, cfg: BertConfig, summary: dict[str, Any] | None,
               record: dict[str, Any] | None, train_cfg: TrainConfig | None = None) -> str:
    """``README.md``: what was trained, how it communicated, and how far it got. The run's numbers
    come from ``summary`` (``summary.json``; None for a run that stopped before its end), the
    exported step's from ``record`` (its line of ``metrics.jsonl``), the settings from ``summary``
    or else ``train_cfg`` (its ``config.toml``)."""
    settings = {} if train_cfg is None else {k: getattr(train_cfg, k) for k in ("model", "workers", "backend")}
    if train_cfg is not None:
        settings["spec"] = train_cfg.compressor
    s = {**settings, **(summary or {})}
    spec = s.get("spec") or s.get("compressor") or "not recorded"
    rows = [
        ("model", f"BERT{_PRE_LN_NOTE if cfg.pre_layer_norm else ''}, {cfg.num_hidden_layers} layers, "
                  f"hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, "
                  f"vocabulary {cfg.vocab_size}" + (f" ({s['model']})" if s.get("model") else "")),
        ("compressor", f"`{spec}`" + (f", exchange {s['exchange']}" if s.get("exchange") else "")),
        ("workers, backend", f"{s.get('workers', 'not recorded')}, {s.get('backend', 'not recorded')}"
                             + (f", sharded ({s['sharding']})" if s.get("sharding", "none") != "none" else "")),
        ("exported checkpoint", f"step {step}" + (f" of {s['steps']}" if isinstance(s.get("steps"), int) else "")),
        ("steps", _num(s.get("steps"))),
        ("tokens", _num(s.get("tokens"))),
        ("bytes sent per rank (total)", _num(s.get("bytes_total"))),
        ("compression ratio", _num(s.get("compression_ratio"), ".1f")),
        ("final training loss", _num(s.get("final_loss"), ".4f")),
        ("final held-out loss (MLM + NSP)", _num(s.get("final_eval_loss"), ".4f")),
        ("final held-out MLM loss", _num(s.get("final_eval_mlm_loss"), ".4f")),
        ("final held-out MLM accuracy", _num(s.get("final_eval_mlm_acc"), ".4f")),
    ]
    if record:
        rows.append((f"training loss at step {step}", _num(record.get("loss"), ".4f")))
        rows.append((f"tokens up to step {step}", _num(record.get("tokens"))))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    note = "" if summary else "\nThe run has no summary.json (it stopped before its end): no totals.\n"
    if cfg.pre_layer_norm:
        usage = ("from transformers import BertTokenizerFast, RobertaPreLayerNormForMaskedLM\n\n"
                 f'tokenizer = BertTokenizerFast.from_pretrained("{out.name}")\n'
                 f'model = RobertaPreLayerNormForMaskedLM.from_pretrained("{out.name}")  # the NSP head is not '
                 "exported")
    else:
        usage = ("from transformers import BertForMaskedLM, BertTokenizerFast\n\n"
                 f'tokenizer = BertTokenizerFast.from_pretrained("{out.name}")\n'
                 f'model = BertForMaskedLM.from_pretrained("{out.name}")  # or BertForPreTraining for both heads')
    return f"""---
library_name: transformers
pipeline_tag: fill-mask
tags:
- bert
- gradzip
- gradient-compression
---

# {run.name}

BERT pretrained (masked LM + next sentence) by `gradzip train`, data-parallel with the gradient
compressor below, exported from checkpoint step {step} with `gradzip export RUN_DIR --to hf {out.name}`.

| | |
|---|---|
{table}
{note}
Bytes are what each rank sent over the (simulated or real) network during training; the losses
are gradzip's, on its held-out split of the training corpus.

```python
{usage}
```
"""


# ---------------------------------------------------------------------- writing
def _write_dir(out: Path, write: Any) -> Path:
    """Call ``write(tmp)`` on a new temporary sibling of ``out``, then rename it to ``out`` (an empty
    ``out`` is replaced); on any failure the temporary directory is removed and ``out`` untouched."""
    parent = out.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".gztmp", dir=parent))
    except OSError as e:
        raise GradzipError(f"cannot create {out} ({e.strerror or type(e).__name__}); choose a directory "
                           "you can write to") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        write(tmp)
        # mkdtemp (and safetensors) make private files; an export is an ordinary, shareable directory
        tmp.chmod(0o777 & ~umask)
        for f in tmp.iterdir():
            f.chmod(0o666 & ~umask)
        if out.is_dir():
            out.rmdir()  # empty (checked): fails rather than deletes if something appeared since
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise GradzipError(f"cannot write {out} ({e.strerror or type(e).__name__}); nothing was written") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
