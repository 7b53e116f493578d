"""The WordNet task and corpus, on a small WordNet database the tests write in WordNet's format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gradzip.data.corpus import load_corpus
from gradzip.data.wordnet import (
    LEXNAMES,
    corpus_documents,
    is_validation,
    read_synsets,
    write_wordnet_task,
)
from gradzip.errors import GradzipError

_HEADER = "  1 This software and database is being provided to you, the LICENSEE, by Princeton University\n"
_CLASSES = {"noun.animal": 5, "noun.artifact": 6, "noun.person": 18, "noun.plant": 20}


def _line(offset: int, lex: str, words: list[str], gloss: str) -> str:
    ws = " ".join(f"{w.replace(' ', '_')} 0" for w in words)
    return f"{offset:08d} {LEXNAMES.index(lex):02d} n {len(words):02x} {ws} 000 | {gloss}  \n"


def make_wordnet(root: Path, per_class: int = 40) -> Path:
    """A database of ``per_class`` noun synsets in each of 4 classes, plus a verb file."""
    root.mkdir(parents=True, exist_ok=True)
    lines, offset = [_HEADER], 1000
    for lex in _CLASSES:
        for k in range(per_class):
            kind = lex.split(".")[1]
            lines.append(_line(offset, lex, [f"{kind}{k}", f"{kind} number {k}"],
                               f'a {kind} of sort {k}; "the {kind}{k} was seen"'))
            offset += 137
    (root / "data.noun").write_text("".join(lines))
    (root / "data.verb").write_text(_HEADER + "00001740 29 v 01 breathe 0 000 | draw air into the lungs  \n")
    return root


def test_reads_synsets_and_lexnames(tmp_path: Path) -> None:
    d = make_wordnet(tmp_path / "wn", per_class=3)
    syn = list(read_synsets(d, "noun"))
    assert len(syn) == 12
    first = syn[0]
    assert first.lexname == "noun.animal" and first.words == ("animal0", "animal number 0")
    assert first.sentences() == ["a animal of sort 0", "the animal0 was seen"]
    assert LEXNAMES[3] == "noun.Tops" and LEXNAMES[28] == "noun.time" and LEXNAMES[29] == "verb.body"


def test_task_splits_are_disjoint_and_labelled(tmp_path: Path) -> None:
    d = make_wordnet(tmp_path / "wn", per_class=60)
    train, val = write_wordnet_task(tmp_path / "task", directory=d)
    rows = {p.name: [json.loads(x) for x in p.read_text().splitlines()] for p in (train, val)}
    texts = {name: {r["text"] for r in rs} for name, rs in rows.items()}
    assert texts["train.jsonl"].isdisjoint(texts["validation.jsonl"])
    assert len(rows["train.jsonl"]) + len(rows["validation.jsonl"]) == 240  # every synset, once
    syn = {s.sentences()[0]: s for s in read_synsets(d, "noun")}
    for name, rs in rows.items():
        for r in rs:
            s = syn[r["text"].split("; ")[0]]
            assert r["label"] == s.lexname
            assert is_validation(s.offset) == (name == "validation.jsonl")
            assert not any(w in r["text"].split("; ")[0] for w in s.words)  # the gloss, not the words
    assert 5 <= len(rows["validation.jsonl"]) <= 50  # about 10%


def test_task_samples_and_seed(tmp_path: Path) -> None:
    d = make_wordnet(tmp_path / "wn", per_class=60)
    a = write_wordnet_task(tmp_path / "a", 50, 10, seed=1, directory=d)
    b = write_wordnet_task(tmp_path / "b", 50, 10, seed=1, directory=d)
    c = write_wordnet_task(tmp_path / "c", 50, 10, seed=2, directory=d)
    assert a[0].read_text() == b[0].read_text() and a[0].read_text() != c[0].read_text()
    train = [json.loads(x) for x in a[0].read_text().splitlines()]
    val = [json.loads(x) for x in a[1].read_text().splitlines()]
    assert len(train) == 50 and len(val) == 10
    assert {r["label"] for r in val} <= {r["label"] for r in train}
    with pytest.raises(GradzipError, match="not an empty directory"):
        write_wordnet_task(tmp_path / "a", 5, 5, directory=d)


def test_corpus_leaves_out_validation_glosses(tmp_path: Path) -> None:
    d = make_wordnet(tmp_path / "wn", per_class=60)
    docs = list(corpus_documents(d))
    lines = {s for doc in docs for s in doc}
    for s in read_synsets(d, "noun"):
        assert (f"{', '.join(s.words)}: {s.sentences()[0]}" in lines) == (not is_validation(s.offset))
    assert "breathe: draw air into the lungs" in lines
    assert all(len(doc) <= 2 * 8 for doc in docs)  # 8 synsets a document, 2 sentences each
    corpus = load_corpus(f"wordnet:{d}", cache_dir=tmp_path / "cache", progress=False)
    assert corpus.num_docs == len(docs) and "WordNet" in corpus.description


def test_missing_wordnet_is_one_line_exit_2(tmp_path: Path) -> None:
    out = tmp_path / "task"
    p = subprocess.run([sys.executable, "-m", "gradzip", "finetune", "--make-wordnet", str(out)],
                       capture_output=True, text=True, env={"GRADZIP_WORDNET": str(tmp_path / "none"),
                                                            "PATH": "/usr/bin:/bin"})
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "apt-get install wordnet-base" in p.stderr
    assert not out.exists()


def test_make_wordnet_cli(tmp_path: Path) -> None:
    d = make_wordnet(tmp_path / "wn", per_class=30)
    out = tmp_path / "task"
    p = subprocess.run([sys.executable, "-m", "gradzip", "finetune", "--make-wordnet", str(out),
                        "--examples", "20", "5"], capture_output=True, text=True,
                       env={"GRADZIP_WORDNET": str(d), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    assert len((out / "train.jsonl").read_text().splitlines()) == 20
    assert len((out / "validation.jsonl").read_text().splitlines()) == 5
