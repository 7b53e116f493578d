"""Sweeps that speak downstream: pretraining → export → fine-tuning, per cell (spec ``[downstream]``).

A spec with a ``[downstream]`` table fine-tunes every cell's pretrained model once the cell has
finished (or was finished before), on rank 0::

    [downstream]
    task = "keywords"          # the synthetic keyword task, built from the cell's corpus, or "wordnet"
                               # (gradzip.data.wordnet: the same sample for every cell) ...
    # train = "data/train.jsonl"        # ... or files (csv/tsv/jsonl), or hf:glue:sst2-style names
    # validation = "data/validation.jsonl"
    seeds = 3                  # fine-tuning seeds per cell
    epochs = 5
    lr = 3e-4                  # unset: 3 epochs at 5e-5 (BERT-base's recipe, too gentle for bert-tiny)
    batch_size = 32
    seq_len = 64
    examples = [1000, 500]     # keywords: train and validation examples

For a cell in ``DIR``, everything goes under ``DIR/downstream/``: ``hf/`` (``gradzip export``'s
Hugging Face directory of the cell's last checkpoint), ``task/`` (the keyword task's files),
``seed=S/`` (one ``gradzip finetune`` run each: its ``summary.json`` and ``metrics.jsonl``), and
``summary.json``: the mean ``accuracy`` and ``f1`` over the seeds, each seed's, and the cell's
pretraining ``bytes_total``. A finished seed is not run again; one that ran another recipe (or a
task of other sizes) is a one-line error for that cell, never silently reused or overwritten. ``gradzip plot``'s figure
``downstream_vs_bytes`` draws downstream accuracy against the bytes sent in pretraining.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradzip.data.corpus import load_corpus
from gradzip.data.synthetic_cls import FILES, write_keyword_task
from gradzip.data.wordnet import write_wordnet_task
from gradzip.errors import GradzipError, SpecError
from gradzip.io import atomic_write_json
from gradzip.training.export import export_hf
from gradzip.training.finetune import FinetuneConfig, finetune

KEYS = {"task", "train", "validation", "seeds", "epochs", "lr", "batch_size", "seq_len", "examples"}
TASKS = ("keywords", "wordnet")


@dataclass(frozen=True)
class Downstream:
    task: str | None = "keywords"
    train: str | None = None
    validation: str | None = None
    seeds: int = 1
    epochs: int = 3
    lr: float = 5e-5
    batch_size: int = 32
    seq_len: int = 64
    examples: tuple[int, int] = (1000, 500)


def parse_downstream(table: Any, src: Path) -> Downstream:
    """The ``[downstream]`` table; a bad key or value is a one-line :class:`SpecError`."""
    if not isinstance(table, dict):
        raise SpecError(f"{src}: [downstream] must be a table")
    unknown = sorted(set(table) - KEYS)
    if unknown:
        raise SpecError(f"{src}: [downstream] has no key {unknown[0]!r}; keys: {', '.join(sorted(KEYS))}")
    files = "train" in table or "validation" in table
    if files and not ("train" in table and "validation" in table):
        raise SpecError(f"{src}: [downstream] needs both train and validation (files or hf: names)")
    if files and "task" in table:
        raise SpecError(f"{src}: [downstream] takes task = \"keywords\" or train/validation files, not both")
    task = None if files else table.get("task", "keywords")
    if task not in (None, *TASKS):
        raise SpecError(f"{src}: [downstream] task must be \"keywords\" (the synthetic task) or \"wordnet\" "
                        f"(WordNet's noun glosses), got {task!r}")
    try:
        ds = Downstream(task, table.get("train"), table.get("validation"), int(table.get("seeds", 1)),
                        int(table.get("epochs", 3)), float(table.get("lr", 5e-5)), int(table.get("batch_size", 32)),
                        int(table.get("seq_len", 64)), tuple(int(x) for x in table.get("examples", (1000, 500))))
    except (TypeError, ValueError) as e:
        raise SpecError(f"{src}: [downstream]: {e}") from None
    if ds.seeds < 1 or ds.epochs < 1 or ds.batch_size < 1 or ds.seq_len < 8 or not ds.lr > 0 or \
            len(ds.examples) != 2 or min(ds.examples) < 2:
        raise SpecError(f"{src}: [downstream] seeds, epochs, batch_size >= 1, seq_len >= 8, lr > 0, and examples "
                        "two counts >= 2 (train, validation)")
    return ds


def run_downstream(cell_dir: Path, config: dict[str, Any], ds: Downstream, echo: bool = True) -> dict[str, Any]:
    """Export, build the task, fine-tune each seed (module docstring); returns the downstream summary."""
    root = cell_dir / "downstream"
    hf = root / "hf"
    if not (hf / "config.json").is_file():
        export_hf(cell_dir, hf)
    if ds.task in TASKS:
        task = root / "task"
        if not all((task / f).is_file() for f in FILES):
            if ds.task == "wordnet":  # seed 0 for every cell: they all fine-tune on the same sample
                write_wordnet_task(task, *ds.examples, seed=0)
            else:
                write_keyword_task(task, load_corpus(config.get("corpus"), progress=False), *ds.examples,
                                   seed=int(config.get("seed", 0)))
        train, validation = str(task / FILES[0]), str(task / FILES[1])
        counts = tuple(sum(1 for line in open(f, encoding="utf-8") if line.strip()) for f in (train, validation))
        if counts != tuple(ds.examples):
            raise GradzipError(f"{task} holds {counts[0]} + {counts[1]} examples, not the {ds.examples[0]} + "
                               f"{ds.examples[1]} that [downstream] asks for; move {root} away or use another --out")
    else:
        train, validation = str(ds.train), str(ds.validation)
    runs = []
    for seed in range(ds.seeds):
        out = root / f"seed={seed}"
        done = _read(out / "summary.json")
        if done is not None:
            _check_recipe(done, ds, seed, out)
        else:
            done = finetune(FinetuneConfig(checkpoint=str(hf), train=train, validation=validation, out=str(out),
                                           epochs=ds.epochs, lr=ds.lr, batch_size=ds.batch_size, seq_len=ds.seq_len,
                                           seed=seed), echo=print if echo else None)
        runs.append({"seed": seed, "accuracy": done.get("accuracy"), "f1": done.get("f1")})
    pre = _read(cell_dir / "summary.json") or {}
    accs = [r["accuracy"] for r in runs if isinstance(r["accuracy"], (int, float))]
    f1s = [r["f1"] for r in runs if isinstance(r["f1"], (int, float))]
    summary = {"accuracy": sum(accs) / len(accs) if accs else None, "f1": sum(f1s) / len(f1s) if f1s else None,
               "accuracy_min": min(accs, default=None), "accuracy_max": max(accs, default=None),
               "seeds": runs, "task": ds.task or "files", "bytes_total": pre.get("bytes_total"),
               "compressor": pre.get("compressor"), "final_eval_mlm_loss": pre.get("final_eval_mlm_loss")}
    atomic_write_json(root / "summary.json", summary)
    return summary


def _check_recipe(done: dict[str, Any], ds: Downstream, seed: int, out: Path) -> None:
    """A finished seed is reused only if it ran the recipe [downstream] asks for now."""
    got = done.get("settings") or {}
    want = {"epochs": ds.epochs, "lr": ds.lr, "batch_size": ds.batch_size, "seq_len": ds.seq_len, "seed": seed}
    diff = [k for k, v in want.items() if got.get(k) != v]
    if ds.task in TASKS and done.get("examples") != {"train": ds.examples[0], "validation": ds.examples[1]}:
        diff.append("examples")
    if diff:
        raise GradzipError(f"{out} was fine-tuned with other settings ({', '.join(diff)} differ from [downstream]); "
                           "move it away or use another --out")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def downstream_step(cell_dir: Path, config: dict[str, Any], ds: Downstream, echo: bool = True) -> str | None:
    """:func:`run_downstream` for the sweep: None when it worked, else the one-line reason (the sweep goes on)."""
    try:
        s = run_downstream(cell_dir, config, ds, echo)
    except GradzipError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a failing fine-tune must not stop the sweep
        return f"{type(e).__name__}: {e}".splitlines()[0][:300]
    if echo and s.get("accuracy") is not None:
        print(f"  downstream: accuracy {s['accuracy']:.4f} over {len(s['seeds'])} seed(s)", flush=True)
    return None
