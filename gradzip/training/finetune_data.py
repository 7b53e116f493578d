"""The data of ``gradzip finetune``: labelled texts from a local CSV/JSONL file or a Hugging Face
data set, their label ids, their token ids, and the metrics of predictions.

Input, one example per row (CSV with a header) or line (JSONL, one object a line):

- ``text`` (a single text), or ``text_a`` and ``text_b`` (a pair: ``[CLS] A [SEP] B [SEP]``), or
  ``text_a`` alone;
- ``label``: an integer or a string. Labels are mapped to ids in sorted order (numerically when
  every label is an integer, CSV digits included; as strings otherwise) over the training set.

``hf:NAME[:CONFIG[:SPLIT]]`` (``hf:glue:sst2``) reads ``datasets.load_dataset(NAME, CONFIG,
split=SPLIT)``; the split defaults to ``train`` for ``--train`` and ``validation`` for
``--validation``, and the text columns are found by name (``sentence``; ``sentence1``/``sentence2``;
``question``/``sentence``; ...). Every problem is a one-line :class:`GradzipError` naming the file,
the line and the fix.
"""

from __future__ import annotations

import csv
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gradzip.data import WordPieceTokenizer
from gradzip.errors import GradzipError

# Text columns of Hugging Face data sets (GLUE, SuperGLUE, IMDb, ...), tried in this order.
HF_TEXT_COLUMNS = (("text_a", "text_b"), ("sentence1", "sentence2"), ("question1", "question2"),
                   ("question", "sentence"), ("premise", "hypothesis"), ("sentence", None), ("text", None))
_INT = re.compile(r"[+-]?\d+")


@dataclass
class Example:
    """One labelled input: ``text_b`` is None for a single text; ``label`` as read (int or str)."""

    text_a: str
    text_b: str | None
    label: int | str


# ---------------------------------------------------------------------- reading
def read_examples(spec: str, role: str) -> list[Example]:
    """The examples of ``spec`` (a ``.csv``/``.tsv``/``.jsonl``/``.json`` path or ``hf:...``) for
    ``role`` (``"train"`` or ``"validation"``, the default Hugging Face split); never empty."""
    flag = f"--{role}"
    if spec.startswith("hf:"):
        examples = _read_hf(spec, role)
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise GradzipError(f"{flag} {spec}: no such file; give a CSV or JSONL file (or hf:glue:sst2)")
        suffix = path.suffix.lower()
        if suffix in (".csv", ".tsv"):
            examples = _read_csv(path, "\t" if suffix == ".tsv" else ",")
        elif suffix in (".jsonl", ".json"):
            examples = _read_jsonl(path)
        else:
            raise GradzipError(f"{flag} {spec}: unknown file type {suffix or '(none)'}; use .csv, .tsv or .jsonl")
    if not examples:
        raise GradzipError(f"{flag} {spec} holds no examples")
    if len({e.text_b is None for e in examples}) > 1:
        raise GradzipError(f"{flag} {spec}: some examples have a text_b and some not; give text_b for all or none")
    return examples


def _example(row: dict[str, Any], where: str) -> Example:
    """An :class:`Example` from a row's ``text``/``text_a``/``text_b``/``label`` fields."""
    keys = ", ".join(sorted(map(str, row))) or "none"
    text = row.get("text_a", row.get("text"))
    if text is None:
        raise GradzipError(f"{where}: no text column (has {keys}); name it text, or text_a (and text_b) for pairs")
    if "label" not in row or row["label"] is None or row["label"] == "":
        raise GradzipError(f"{where}: no label (has {keys}); every example needs a label")
    label = row["label"]
    if isinstance(label, bool) or not isinstance(label, int | str):
        raise GradzipError(f"{where}: label {label!r} is not an integer or a string")
    pair = row.get("text_b")
    if not isinstance(text, str) or not isinstance(pair, str | None):
        raise GradzipError(f"{where}: the texts must be strings")
    return Example(text, pair, label.strip() if isinstance(label, str) else label)


def _read_csv(path: Path, delimiter: str) -> list[Example]:
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            reader = csv.DictReader(fh, delimiter=delimiter)
            rows = list(reader)
            header = reader.fieldnames or []
    except UnicodeDecodeError:
        raise GradzipError(f"{path} is not UTF-8 text") from None
    except csv.Error as e:
        raise GradzipError(f"{path}: not a valid CSV file ({e})") from None
    if not ({"text", "text_a"} & set(header) and "label" in header):
        raise GradzipError(f"{path}: the header has {', '.join(header) or 'no columns'}; it needs text (or text_a "
                           "and text_b) and label")
    return [_example({k: v for k, v in row.items() if k is not None}, f"{path} row {n}")
            for n, row in enumerate(rows, 1)]


def _read_jsonl(path: Path) -> list[Example]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise GradzipError(f"{path} is not UTF-8 text") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise GradzipError(f"{path} line {n}: not JSON ({e.msg}); JSONL holds one object a line") from None
        if not isinstance(row, dict):
            raise GradzipError(f"{path} line {n}: a {type(row).__name__}, not an object with text and label")
        out.append(_example(row, f"{path} line {n}"))
    return out


def _read_hf(spec: str, role: str) -> list[Example]:
    """``hf:NAME[:CONFIG[:SPLIT]]`` through ``datasets``; one line naming the cause if it fails."""
    parts = spec[3:].split(":")
    if not parts[0] or len(parts) > 3:
        raise GradzipError(f"--{role} {spec}: write hf:NAME[:CONFIG[:SPLIT]], e.g. hf:glue:sst2")
    name, config, split = parts[0], (parts[1:2] or [None])[0] or None, (parts[2:3] or [role])[0]
    try:
        import datasets
    except ModuleNotFoundError:
        raise GradzipError(f"--{role} {spec} needs the datasets package (pip install datasets), which is not "
                           "installed; or give a local CSV/JSONL file") from None
    # Their retry warnings ("Retrying in 8s") would bury the one line that names the cause.
    loggers = [logging.getLogger(n) for n in ("huggingface_hub", "datasets")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # offline, unknown name or split: datasets raises many types
        why = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)[:200]
        raise GradzipError(f"--{role} {spec}: datasets.load_dataset({name!r}, {config!r}, split={split!r}) failed "
                           f"({type(e).__name__}: {why}); is the network reachable? or give a local CSV/JSONL "
                           "file") from None
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    columns = set(ds.column_names)
    text_cols = next(((a, b) for a, b in HF_TEXT_COLUMNS if a in columns and (b is None or b in columns)), None)
    if text_cols is None or "label" not in columns:
        raise GradzipError(f"--{role} {spec}: columns {', '.join(sorted(columns))} have no known text column or "
                           "no label; convert it to a CSV/JSONL file with text (or text_a/text_b) and label")
    a, b = text_cols
    labels = list(ds["label"])
    if any(isinstance(x, int) and x < 0 for x in labels):  # GLUE's test splits: label -1
        raise GradzipError(f"--{role} {spec}: the split {split!r} has no labels (-1); use a labelled split, "
                           "e.g. validation")
    return [Example(x, y, lab) for x, y, lab in zip(ds[a], ds[b] if b else [None] * len(labels), labels)]


# ---------------------------------------------------------------------- labels
def label_names(train: list[Example], validation: list[Example]) -> list[int | str]:
    """The label names in id order: the training set's labels, sorted (numerically if every one
    is an integer, CSV digits included; else as strings). A validation label the training set
    lacks is an error: the model could never predict it."""
    def norm(x: int | str) -> int | str:
        return int(x) if isinstance(x, str) and _INT.fullmatch(x) else x

    raw = {norm(e.label) for e in train}
    numeric = all(isinstance(x, int) for x in raw)
    names = sorted(raw) if numeric else sorted({str(x) for x in raw})
    ids = label_ids(names)
    unknown = sorted({str(e.label) for e in validation if _key(e.label, numeric) not in ids})
    if unknown:
        raise GradzipError(f"--validation has label(s) {', '.join(unknown[:5])} that --train lacks (its labels: "
                           f"{', '.join(map(str, names[:10]))}); check the files")
    if len(names) < 2:
        raise GradzipError(f"--train has one label ({names[0]}); classification needs at least two")
    return names


def _key(label: int | str, numeric: bool) -> int | str:
    if numeric:
        return int(label) if isinstance(label, int) or _INT.fullmatch(label) else str(label)
    return str(label)


def label_ids(names: list[int | str]) -> dict[int | str, int]:
    """Name -> id (its index in ``names``)."""
    return {n: i for i, n in enumerate(names)}


def label_tensor(examples: list[Example], names: list[int | str]) -> Tensor:
    """The label ids of ``examples`` (names from :func:`label_names`)."""
    ids, numeric = label_ids(names), all(isinstance(n, int) for n in names)
    return torch.tensor([ids[_key(e.label, numeric)] for e in examples], dtype=torch.long)


# ---------------------------------------------------------------------- token ids
@dataclass
class Encoded:
    """Padded token ids of a data set (``(n, longest)``, ``longest <= seq_len``) and its labels."""

    input_ids: Tensor
    token_type_ids: Tensor
    attention_mask: Tensor
    labels: Tensor
    truncated: int  # examples cut to seq_len

    def __len__(self) -> int:
        return int(self.labels.numel())

    def batch(self, index: Tensor) -> dict[str, Tensor]:
        """Rows ``index``, cut to their longest row (padding beyond it changes nothing but time)."""
        mask = self.attention_mask[index]
        width = max(1, int(mask.sum(1).max()))
        return {"input_ids": self.input_ids[index, :width], "token_type_ids": self.token_type_ids[index, :width],
                "attention_mask": mask[:, :width], "labels": self.labels[index]}


def encode(tok: WordPieceTokenizer, examples: list[Example], names: list[int | str], seq_len: int) -> Encoded:
    """Token ids as BERT's classifiers take them (``[CLS] A [SEP] (B [SEP])``, segment ids 0/1),
    truncated to ``seq_len`` (longest text first) and padded with ``[PAD]``."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_str(tok.tokenizer.to_str())  # a copy: truncation/padding stay off the run's tokenizer
    t.enable_truncation(max_length=seq_len, strategy="longest_first")
    t.enable_padding(pad_id=tok.pad_id, pad_token="[PAD]")
    inputs = [e.text_a if e.text_b is None else (e.text_a, e.text_b) for e in examples]
    encs = t.encode_batch(inputs, add_special_tokens=True)
    return Encoded(torch.tensor([e.ids for e in encs], dtype=torch.long),
                   torch.tensor([e.type_ids for e in encs], dtype=torch.long),
                   torch.tensor([e.attention_mask for e in encs], dtype=torch.long),
                   label_tensor(examples, names), sum(bool(e.overflowing) for e in encs))


# ---------------------------------------------------------------------- metrics
def classification_metrics(predictions: Tensor, labels: Tensor, num_labels: int) -> dict[str, float]:
    """``accuracy``, and for two classes ``f1`` (of class id 1, the second label in sorted order),
    ``precision`` and ``recall``; an undefined ratio (no positive prediction or label) is 0."""
    predictions, labels = predictions.reshape(-1), labels.reshape(-1)
    out = {"accuracy": float((predictions == labels).double().mean()) if labels.numel() else 0.0}
    if num_labels == 2:
        tp = int(((predictions == 1) & (labels == 1)).sum())
        fp = int(((predictions == 1) & (labels == 0)).sum())
        fn = int(((predictions == 0) & (labels == 1)).sum())
        out["precision"] = tp / (tp + fp) if tp + fp else 0.0
        out["recall"] = tp / (tp + fn) if tp + fn else 0.0
        out["f1"] = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
    return out
