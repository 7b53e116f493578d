"""WordNet as English text: a downstream task (noun glosses labelled with their lexicographer
class) and a pretraining corpus, both from the database that Debian's ``wordnet-base`` installs
(``apt-get install wordnet-base``: ``/usr/share/wordnet/data.{noun,verb,adj,adv}``, WordNet 3.0).

**The task** (``gradzip finetune --make-wordnet DIR``): one example per noun synset, its gloss
(definition and usage examples, without the synset's own words) as ``text`` and its lexicographer
class (``noun.animal``, ``noun.artifact``, ... 26 classes) as ``label``. A synset is in the
validation split iff a hash of its offset says so (:func:`is_validation`, 10% of synsets), so no
synset is in both splits, whatever the sample sizes or seed; the examples are a seeded sample of
each split, the validation ones restricted to classes the training sample has.

**The corpus** (``--corpus wordnet``): every synset of the four parts of speech as
``words: gloss``, the parts of the gloss as sentences, documents of consecutive synsets of one
lexicographer file; the task's validation glosses are left out, so pretraining never sees them.

WordNet's licence (Princeton, BSD-like) allows copying and redistribution with its notice; tests
use a small database they write themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gradzip.errors import GradzipError
from gradzip.io import atomic_write_text

DEFAULT_DIR = "/usr/share/wordnet"
POS_FILES = ("noun", "verb", "adj", "adv")
# The lexicographer files of WordNet 3.0 (lexnames(5WN)), by number.
LEXNAMES = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact", "noun.attribute",
    "noun.body", "noun.cognition", "noun.communication", "noun.event", "noun.feeling", "noun.food", "noun.group",
    "noun.location", "noun.motive", "noun.object", "noun.person", "noun.phenomenon", "noun.plant",
    "noun.possession", "noun.process", "noun.quantity", "noun.relation", "noun.shape", "noun.state",
    "noun.substance", "noun.time", "verb.body", "verb.change", "verb.cognition", "verb.communication",
    "verb.competition", "verb.consumption", "verb.contact", "verb.creation", "verb.emotion", "verb.motion",
    "verb.perception", "verb.possession", "verb.social", "verb.stative", "verb.weather", "adj.ppl",
)
VALIDATION_PERCENT = 10
SYNSETS_PER_DOC = 8  # corpus documents: this many consecutive synsets of one lexicographer file
FILES = ("train.jsonl", "validation.jsonl")


@dataclass(frozen=True)
class Synset:
    offset: int
    pos: str
    lexname: str
    words: tuple[str, ...]
    gloss: str

    def sentences(self) -> list[str]:
        """The gloss's parts (definition; "usage examples"), quotes removed, in order."""
        return [p.strip().strip('"').strip() for p in self.gloss.split(";") if p.strip().strip('"').strip()]


def wordnet_dir(path: str | os.PathLike | None = None) -> Path:
    """The WordNet database directory (``path``, else ``$GRADZIP_WORDNET``, else Debian's), checked."""
    d = Path(path or os.environ.get("GRADZIP_WORDNET") or DEFAULT_DIR).expanduser()
    if not (d / "data.noun").is_file():
        raise GradzipError(f"WordNet is not installed (no {d / 'data.noun'}): install it with "
                           "`apt-get install wordnet-base`, or set GRADZIP_WORDNET to a WordNet 3.0 dict directory")
    return d


def read_synsets(directory: Path, pos: str = "noun") -> Iterator[Synset]:
    """The synsets of ``data.{pos}`` (wndb(5WN): offset lex_filenum ss_type w_cnt word lex_id ... | gloss)."""
    path = directory / f"data.{pos}"
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if line.startswith("  "):  # the licence header
                continue
            head, bar, gloss = line.partition("|")
            fields = head.split()
            try:
                offset, lex, w_cnt = int(fields[0]), int(fields[1]), int(fields[3], 16)
                words = tuple(fields[4 + 2 * i].replace("_", " ") for i in range(w_cnt))
                lexname = LEXNAMES[lex]
            except (IndexError, ValueError):
                raise GradzipError(f"{path}:{n}: not a WordNet data line; is {directory} a WordNet 3.0 dict "
                                   "directory?") from None
            if bar:
                yield Synset(offset, pos, lexname, words, gloss.strip())


def is_validation(offset: int) -> bool:
    """Whether noun synset ``offset`` belongs to the task's validation split (10%, by hash)."""
    digest = hashlib.sha256(f"wordnet-noun-{offset}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < VALIDATION_PERCENT


def task_example(s: Synset) -> dict[str, str]:
    return {"text": "; ".join(s.sentences()), "label": s.lexname}


def check_task_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GradzipError(f"{out} exists and is not an empty directory; choose a new directory for the task files")


def write_wordnet_task(out: str | os.PathLike, n_train: int | None = None, n_val: int | None = None, seed: int = 0,
                       directory: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``validation.jsonl`` (see the module docstring); ``None`` sizes
    take every synset of the split. Returns the two paths."""
    out = Path(out)
    check_task_dir(out)
    for name, n in (("train", n_train), ("validation", n_val)):
        if n is not None and n < 1:
            raise GradzipError(f"--examples: the {name} count must be >= 1, got {n}")
    synsets = [s for s in read_synsets(wordnet_dir(directory), "noun") if s.sentences()]
    train = [s for s in synsets if not is_validation(s.offset)]
    val = [s for s in synsets if is_validation(s.offset)]
    rng = random.Random(seed)
    if n_train is not None:
        train = rng.sample(train, min(n_train, len(train)))
    seen = {s.lexname for s in train}
    val = [s for s in val if s.lexname in seen]  # a class fine-tuning never saw cannot be predicted
    if n_val is not None:
        val = rng.sample(val, min(n_val, len(val)))
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, part in zip(FILES, (train, val)):
        atomic_write_text(out / name, "".join(json.dumps(task_example(s)) + "\n" for s in part))
        paths.append(out / name)
    return paths[0], paths[1]


def corpus_documents(directory: str | os.PathLike | None = None) -> Iterator[list[str]]:
    """The pretraining corpus's documents (module docstring): the task's validation glosses left out."""
    d = wordnet_dir(directory)
    for pos in POS_FILES:
        if not (d / f"data.{pos}").is_file():  # the nouns are required (wordnet_dir), the rest optional
            continue
        doc: list[str] = []
        lex, count = None, 0
        for s in read_synsets(d, pos):
            if pos == "noun" and is_validation(s.offset):
                continue
            if doc and (s.lexname != lex or count == SYNSETS_PER_DOC):
                yield doc
                doc, count = [], 0
            parts = s.sentences()
            if not parts:
                continue
            lex, count = s.lexname, count + 1
            doc.append(f"{', '.join(s.words)}: {parts[0]}")
            doc.extend(parts[1:])
        if doc:
            yield doc
