"""The fine-tuned classifier of ``gradzip finetune`` as a Hugging Face directory, ``OUT/model``.

``transformers.BertForSequenceClassification.from_pretrained(OUT/model)`` (a ``--pre-ln`` run's:
``RobertaPreLayerNormForSequenceClassification``, :func:`classifier_weights`) and
``BertTokenizerFast.from_pretrained(OUT/model)`` load it unchanged (the classifier's parameter
names are HF's, :class:`~gradzip.training.finetune.SequenceClassifier`):

- ``config.json``: the encoder's config as ``gradzip export`` writes it, with
  ``architectures: ["BertForSequenceClassification"]``, ``num_labels``, ``id2label``/``label2id``
  (the labels in id order, as ``summary.json``'s ``labels``) and ``problem_type``;
- ``model.safetensors`` (where ``safetensors`` is installed, the ``hf`` extra) or else
  ``pytorch_model.bin`` (a plain state dict; ``from_pretrained`` reads either);
- the tokenizer files of the source model (:func:`gradzip.training.export.tokenizer_files`);
- ``README.md``: a short card with the source checkpoint, the data and the validation metrics.

It is written into a temporary sibling and renamed, as an export is, so a stopped run leaves no
partial ``model``; ``gradzip finetune`` writes it before ``summary.json``, whose presence marks
the run complete.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradzip.data import WordPieceTokenizer
from gradzip.models import BertConfig
from gradzip.training import export


def _architecture(cfg: BertConfig) -> str:
    return "RobertaPreLayerNormForSequenceClassification" if cfg.pre_layer_norm else "BertForSequenceClassification"


def classifier_config(cfg: BertConfig, weights: dict[str, torch.Tensor], names: list[int | str]) -> dict[str, Any]:
    """``config.json`` of a ``BertForSequenceClassification`` (a pre-LN encoder's:
    ``RobertaPreLayerNormForSequenceClassification``) over ``names`` (the labels in id order)."""
    labels = {str(i): str(n) for i, n in enumerate(names)}
    return {**export.hf_config(cfg, weights), "architectures": [_architecture(cfg)],
            "num_labels": len(names), "id2label": labels, "label2id": {v: int(k) for k, v in labels.items()},
            "problem_type": "single_label_classification"}


def classifier_weights(cfg: BertConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The classifier's weights under HF's names. A pre-LN encoder's are RobertaPreLayerNorm's
    (:func:`gradzip.training.export.hf_weights`), and its head is RoBERTa's classification head,
    ``out_proj(tanh(dense(x[:, 0])))``: the pooler becomes ``classifier.dense`` and the linear
    layer ``classifier.out_proj`` (the same function in eval mode, where dropout is the identity)."""
    if not cfg.pre_layer_norm:
        return weights
    renamed = {"roberta_prelayernorm.pooler.dense.": "classifier.dense.", "classifier.": "classifier.out_proj."}
    out = {}
    for k, v in export.hf_weights(cfg, weights).items():
        prefix = next((p for p in renamed if k.startswith(p)), None)
        out[k if prefix is None else renamed[prefix] + k[len(prefix):]] = v
    return out


def save_classifier(out: Path, model: nn.Module, cfg: BertConfig, tokenizer: WordPieceTokenizer,
                    names: list[int | str], summary: dict[str, Any]) -> Path:
    """Write ``model`` (a fine-tuned :class:`SequenceClassifier`) to the new directory ``out``, as the
    module docstring says; returns ``out``."""
    weights = classifier_weights(cfg, {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()})
    files = {
        "config.json": json.dumps(classifier_config(cfg, weights, names), indent=2) + "\n",
        **export.tokenizer_files(tokenizer, cfg.max_position_embeddings),
        "README.md": _card(summary, _architecture(cfg)),
    }
    try:
        from safetensors.torch import save_file
    except ModuleNotFoundError:
        save_file = None

    def write(tmp: Path) -> None:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        if save_file is not None:
            save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:  # no hf extra: torch's own format, which from_pretrained also reads
            torch.save(weights, tmp / "pytorch_model.bin")

    return export._write_dir(out, write)


def _card(s: dict[str, Any], architecture: str = "BertForSequenceClassification") -> str:
    rows = [("task", "sequence classification, labels " + ", ".join(map(str, s["labels"]))),
            ("fine-tuned from", f"{s['checkpoint']} ({s['checkpoint_kind']}"
                                + (f", step {s['checkpoint_step']})" if s["checkpoint_step"] is not None else ")")),
            ("initialisation", s["init"]), ("training data", f"{s['train']} ({s['examples']['train']} examples)"),
            ("validation data", f"{s['validation']} ({s['examples']['validation']} examples)"),
            ("recipe", ", ".join(f"{k} {v}" for k, v in s["settings"].items()) + f"; {s['steps']} steps"),
            ("validation accuracy", f"{s['accuracy']:.4f}"), ("validation loss", f"{s['eval_loss']:.4f}")]
    if "f1" in s:
        rows.append((f"validation F1 (label {s['positive_label']})", f"{s['f1']:.4f}"))
    table = "".join(f"| {k} | {v} |\n" for k, v in rows)
    return ("---\nlibrary_name: transformers\npipeline_tag: text-classification\n---\n\n"
            "# A BERT sequence classifier fine-tuned by gradzip finetune\n\n"
            f"| | |\n|---|---|\n{table}\n"
            f"```python\nfrom transformers import {architecture}, BertTokenizerFast\n\n"
            f"model = {architecture}.from_pretrained(\"PATH\")\n"
            "tokenizer = BertTokenizerFast.from_pretrained(\"PATH\")\n```\n")
