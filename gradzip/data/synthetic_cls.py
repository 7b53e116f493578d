"""A synthetic sentence-classification task that ships with gradzip: no data set to download or
license, and a model must read the text to solve it.

The **keyword task**: each example is a sentence of a corpus with one word inserted at a random
position. The word is one of :data:`KEYWORDS` (label 1) or one of :data:`DISTRACTORS` (label 0),
and the base sentences contain none of either list, so "label 1 iff a keyword appears in the text"
holds exactly. Every example has one inserted word, so length and position give nothing away: only
which word was inserted decides the label. Classes are balanced (even count: exactly half each),
the train and validation sentences are disjoint, and everything is deterministic for a corpus and
a seed.

    train, validation = write_keyword_task("data/keywords", load_corpus("corpus.txt"))

writes ``train.jsonl`` and ``validation.jsonl`` (one ``{"text": ..., "label": 0 | 1}`` per line),
the input format of ``gradzip finetune``; ``gradzip finetune --make-synthetic DIR`` calls it.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gradzip.data.corpus import Corpus
from gradzip.errors import GradzipError
from gradzip.io import atomic_write_text

# Fruit (label 1) against household objects (label 0): ordinary words a pretrained model has seen
# in similar contexts, none of them common in technical prose (the default corpus is documentation).
KEYWORDS = ("apple", "banana", "cherry", "grape", "lemon", "mango", "orange", "peach")
DISTRACTORS = ("table", "chair", "window", "pencil", "carpet", "mirror", "bottle", "blanket")
MIN_WORDS, MAX_WORDS = 6, 30  # base sentences: long enough to hide a word in, short enough for 64 tokens
FILES = ("train.jsonl", "validation.jsonl")
_WORD = re.compile(r"[a-z]+")


def base_sentences(sentences: Iterable[str]) -> list[str]:
    """The usable base sentences, in their order, each once: ``MIN_WORDS``..``MAX_WORDS`` words and
    none of :data:`KEYWORDS` or :data:`DISTRACTORS` (as a word, in any case)."""
    banned = set(KEYWORDS) | set(DISTRACTORS)
    seen: set[str] = set()
    out = []
    for s in sentences:
        s = " ".join(s.split())
        if s in seen or not MIN_WORDS <= len(s.split()) <= MAX_WORDS or banned & set(_WORD.findall(s.lower())):
            continue
        seen.add(s)
        out.append(s)
    return out


def keyword_examples(sentences: Iterable[str], train: int = 1000, validation: int = 500,
                     seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, validation)`` records of the keyword task (module docstring) built from
    ``sentences``: ``train`` and ``validation`` examples, each ``{"text": str, "label": 0 | 1}``.

    Raises :class:`GradzipError` if there are fewer usable sentences than examples asked for."""
    if train < 2 or validation < 2:
        raise GradzipError(f"the keyword task needs at least 2 train and 2 validation examples, got {train} and "
                           f"{validation}")
    pool = base_sentences(sentences)
    if len(pool) < train + validation:
        raise GradzipError(f"the corpus has {len(pool)} usable sentences ({MIN_WORDS}-{MAX_WORDS} words, no keyword), "
                           f"fewer than the {train + validation} examples asked for; use a larger corpus or fewer "
                           "examples")
    rng = random.Random(seed)
    rng.shuffle(pool)

    def make(chosen: list[str]) -> list[dict[str, Any]]:
        labels = [i % 2 for i in range(len(chosen))]
        rng.shuffle(labels)
        records = []
        for sentence, label in zip(chosen, labels):
            words = sentence.split()
            word = rng.choice(KEYWORDS if label else DISTRACTORS)
            words.insert(rng.randrange(len(words) + 1), word)
            records.append({"text": " ".join(words), "label": label})
        return records

    return make(pool[:train]), make(pool[train:train + validation])


def corpus_sentences(corpus: Corpus) -> Iterable[str]:
    """Every sentence of a normalised corpus (one sentence a line, documents split by blank lines)."""
    for doc in corpus.documents():
        yield from doc


def check_task_dir(out: Path) -> tuple[Path, Path]:
    """The two files of the task in ``out``; :class:`GradzipError` if ``out`` is not a directory or
    already holds either (checked before a corpus is loaded: nothing is ever overwritten)."""
    paths = (out / FILES[0], out / FILES[1])
    if out.exists() and not out.is_dir():
        raise GradzipError(f"{out} exists and is not a directory; choose a directory for the synthetic task")
    taken = [p.name for p in paths if p.exists()]
    if taken:
        raise GradzipError(f"{out} already holds {' and '.join(taken)}; choose a new directory "
                           "(nothing is overwritten)")
    return paths


def write_keyword_task(out_dir: str | os.PathLike[str], corpus: Corpus | Iterable[str], train: int = 1000,
                       validation: int = 500, seed: int = 0) -> tuple[Path, Path]:
    """Write ``out_dir/train.jsonl`` and ``out_dir/validation.jsonl`` of the keyword task from a
    corpus (a :class:`Corpus` or any iterable of sentences); returns their paths.

    ``out_dir`` is created if needed; an existing ``train.jsonl`` or ``validation.jsonl`` there is
    never overwritten (:class:`GradzipError`, nothing written)."""
    out = Path(out_dir)
    paths = check_task_dir(out)
    sentences = corpus_sentences(corpus) if isinstance(corpus, Corpus) else corpus
    sets = keyword_examples(sentences, train, validation, seed)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for path, records in zip(paths, sets):
            atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    except OSError as e:
        raise GradzipError(f"cannot write the synthetic task to {out} ({e.strerror or type(e).__name__})") from None
    return paths[0], paths[1]
