"""The ``fortunes`` and ``python-doc`` corpora, on small sample directories the tests write."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradzip.data.corpus import load_corpus
from gradzip.data.prose import fortune_files, fortune_paragraphs, python_doc_paragraphs
from gradzip.errors import GradzipError

_WISDOM = """A fake fortuneteller can be tolerated.  But an authentic soothsayer should
be shot on sight.  Cassandra did not get half the kicking around she deserved.
\t\t-- R. A. Heinlein
%
Too short to keep.
%
A lifetime isn't nearly long enough to figure out what it's all about, they say.
%
"""
# The second file repeats a fortune of the first (dropped) and overstrikes a word (b\bbo\bol\bld).
_PEOPLE = """A lifetime isn't nearly long enough to figure out what it's all about, they say.
%
The b\x08bo\x08ol\x08ld man walked into the shop and asked for the price of the moon.

He was told that it was not for sale, and he went home to think about it.
\t-- Anonymous
%
"""

_REST = """:mod:`spam` --- Spam and eggs
=============================

.. module:: spam
   :synopsis: Spam and eggs.

This module provides a way to make spam from eggs, and it is the only one that does so.

.. function:: fry(eggs, *, spam=None)

   Fry the *eggs* in a pan and return them, with the spam on the side if it is given.

   .. versionadded:: 3.2

Here is how it is used in a program::

   import spam
   spam.fry(3)

.. code-block:: python

   this is code that is not prose at all, and it should be dropped from the corpus

Permission to use, copy and modify this software is granted under the licence of the project.
"""


def make_fortunes(root: Path) -> Path:
    root.mkdir(parents=True)
    for name, text in (("wisdom", _WISDOM), ("people", _PEOPLE), ("notes", "No index, so this file is not read.\n")):
        (root / name).write_text(text)
        if name != "notes":
            (root / f"{name}.dat").write_bytes(b"\0\0\0\2")
            (root / f"{name}.u8").symlink_to(name)
    (root / "off").mkdir()  # fortunes-off's directory: not read
    (root / "off" / "rude").write_text("Not read at all because it lives in a subdirectory of the directory.\n%\n")
    (root / "off" / "rude.dat").write_bytes(b"\0")
    return root


def make_python_doc(root: Path) -> Path:
    (root / "_sources" / "library").mkdir(parents=True)
    (root / "_sources" / "library" / "spam.rst.txt").write_text(_REST)
    (root / "_sources" / "about.rst.txt").write_text("These documents are generated from the sources of the "
                                                     "manual by Sphinx, a document processor.\n")
    (root / "library").mkdir()
    (root / "library" / "spam.html").write_text("<p>The HTML is not read.</p>\n")
    return root


def test_fortune_files_need_their_index(tmp_path: Path) -> None:
    d = make_fortunes(tmp_path / "fortunes")
    assert [p.name for p in fortune_files(d)] == ["people", "wisdom"]


def test_fortunes_are_cleaned_one_document_each() -> None:
    assert list(fortune_paragraphs(_WISDOM)) == [
        ["A fake fortuneteller can be tolerated. But an authentic soothsayer should be shot on sight. "
         "Cassandra did not get half the kicking around she deserved."],
        ["A lifetime isn't nearly long enough to figure out what it's all about, they say."],
    ]
    assert list(fortune_paragraphs(_PEOPLE))[1] == [
        "The bold man walked into the shop and asked for the price of the moon.",
        "He was told that it was not for sale, and he went home to think about it."]


def test_fortunes_corpus_dedups_and_caches(tmp_path: Path) -> None:
    d = make_fortunes(tmp_path / "fortunes")
    corpus = load_corpus(f"fortunes:{d}", cache_dir=tmp_path / "cache", progress=False)
    docs = list(corpus.documents())
    # people (sorted first): its 2 fortunes; wisdom: the Heinlein one (3 sentences), its repeat dropped
    assert [len(doc) for doc in docs] == [1, 2, 3]
    assert docs[0] == ["A lifetime isn't nearly long enough to figure out what it's all about, they say."]
    assert corpus.source == f"fortunes:{d}" and corpus.directory.name.startswith("fortunes-")
    assert load_corpus(f"fortunes:{d}", cache_dir=tmp_path / "cache", progress=False).directory == corpus.directory
    (d / "wisdom").write_text(_WISDOM + "A new fortune is added to the file, and the corpus is built again.\n%\n")
    os.utime(d / "wisdom", ns=(1, 1))
    rebuilt = load_corpus(f"fortunes:{d}", cache_dir=tmp_path / "cache", progress=False)
    assert rebuilt.directory != corpus.directory and rebuilt.num_docs == 4


def test_python_doc_keeps_descriptions_drops_code_and_licence() -> None:
    assert python_doc_paragraphs(_REST) == [
        "This module provides a way to make spam from eggs, and it is the only one that does so.",
        "Fry the eggs in a pan and return them, with the spam on the side if it is given.",
        "Here is how it is used in a program:",  # the literal block's lead-in stays, as in docstrings
    ]


def test_python_doc_corpus(tmp_path: Path) -> None:
    d = make_python_doc(tmp_path / "html")
    corpus = load_corpus(f"python-doc:{d}", cache_dir=tmp_path / "cache", progress=False)
    assert list(corpus.documents()) == [
        ["These documents are generated from the sources of the manual by Sphinx, a document processor."],
        ["This module provides a way to make spam from eggs, and it is the only one that does so.",
         "Fry the eggs in a pan and return them, with the spam on the side if it is given.",
         "Here is how it is used in a program:"],
    ]
    assert corpus.directory.name.startswith("python-doc-")


@pytest.mark.parametrize(("spec", "package"), [("fortunes", "fortunes"), ("python-doc", "python3-doc")])
def test_missing_package_names_it(tmp_path: Path, spec: str, package: str) -> None:
    with pytest.raises(GradzipError, match=f"apt-get install {package}"):
        load_corpus(f"{spec}:{tmp_path / 'none'}", cache_dir=tmp_path / "cache", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(GradzipError, match=f"apt-get install {package}"):
        load_corpus(f"{spec}:{tmp_path / 'empty'}", cache_dir=tmp_path / "cache", progress=False)
    assert not list((tmp_path / "cache").glob("corpora/*"))


def test_missing_package_is_one_line_exit_2(tmp_path: Path) -> None:
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "gradzip", "train", "--corpus", f"fortunes:{tmp_path / 'none'}",
                        "--steps", "1", "--out", str(out)], capture_output=True, text=True,
                       env={"GRADZIP_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin",
                            "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "apt-get install fortunes" in p.stderr
    assert not out.exists()
