"""Two corpora of installed English prose, cleaned with the default corpus's filters.

- ``fortunes[:DIR]``: the quotations, jokes and aphorisms of Debian's ``fortunes`` package
  (``apt-get install fortunes``: ``/usr/share/games/fortunes``). A fortune file is a file of the
  directory (not of its subdirectories, where ``fortunes-off`` puts its own) that has a ``.dat``
  index beside it, as fortune(6) requires; its fortunes are separated by ``%`` lines. One fortune
  is one document; attribution lines (``-- Author``) are dropped and overstruck characters
  (``c\\bc``) reduced to one.
- ``python-doc[:DIR]``: the prose of the Python manual from Debian's ``python3-doc``
  (``apt-get install python3-doc``: ``/usr/share/doc/python3-doc/html``), read from the reST
  sources Sphinx ships with the HTML (``_sources/**/*.txt``). One source file (a chapter of the
  tutorial, a library module, ...) is one document. The bodies of object descriptions
  (``.. function::``, ``.. class::``, ...) are the reference's prose and are kept; other
  directives, code and tables are not.

Both are cleaned as the default corpus's docstrings are (:func:`gradzip.data.harvest.clean_docstring`:
markup reduced to text, code, tables, symbol-heavy lines and licence text removed, paragraphs that
are not English sentences dropped) and de-duplicated by paragraph. The cache key is made of the
files read (relative path, size, modification time) and the cleaning's versions, so a package
upgrade rebuilds the corpus.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from gradzip.data import harvest
from gradzip.errors import GradzipError

PROSE_FORMAT = 1
FORTUNES_DIR = "/usr/share/games/fortunes"
PYTHON_DOC_DIR = "/usr/share/doc/python3-doc/html"

_OVERSTRIKE = re.compile(r".\x08")
_SEPARATOR = re.compile(r"^%\s*$", re.M)
_ATTRIBUTION = re.compile(r"^\s*(--|\u2014)")
# Sphinx's object descriptions: the directive line is a signature, its indented body is prose.
_DESCRIPTION = re.compile(
    r"^[ \t]*\.\.[ \t]+(?:(?:py|c|cpp|rst|std):)?(?:function|method|class|attribute|data|exception|decorator|"
    r"decoratormethod|classmethod|staticmethod|abstractmethod|coroutinefunction|coroutinemethod|"
    r"awaitablefunction|awaitablemethod|property|describe|object|opcode|cmdoption|option|envvar|pdbcommand|"
    r"macro|member|type|var|struct|union|enum|enumerator|directive|role|monitoring-event)::.*$", re.M)


def fortune_files(directory: Path) -> list[Path]:
    """The fortune files of ``directory`` (those with a ``.dat`` index beside them), sorted."""
    if not directory.is_dir():
        raise GradzipError(f"fortunes are not installed (no directory {directory}): install them with "
                           "`apt-get install fortunes`, or give fortunes:DIR with a directory of fortune files")
    files = sorted(p for p in directory.iterdir()
                   if p.suffix == "" and not p.name.startswith(".") and p.is_file()
                   and p.with_name(p.name + ".dat").is_file())
    if not files:
        raise GradzipError(f"no fortune files in {directory} (a file with a NAME.dat index beside it): install "
                           "them with `apt-get install fortunes`, or give fortunes:DIR with such files")
    return files


def python_doc_files(directory: Path) -> list[Path]:
    """The reST sources (``_sources/**/*.txt``) of a Sphinx HTML directory, sorted."""
    sources = directory / "_sources"
    files = sorted(p for p in sources.rglob("*.txt") if p.is_file()) if sources.is_dir() else []
    if not files:
        raise GradzipError(f"the Python manual is not installed (no reST sources in {sources}): install it with "
                           "`apt-get install python3-doc`, or give python-doc:DIR with a Sphinx HTML directory "
                           "that has _sources/")
    return files


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8", "replace")
    except OSError as e:
        raise GradzipError(f"cannot read {path} ({e.strerror or type(e).__name__}); make it readable or give "
                           "another corpus") from None


def fortune_paragraphs(text: str) -> Iterator[list[str]]:
    """The prose paragraphs of each fortune of one fortune file's ``text`` (empty fortunes skipped)."""
    for fortune in _SEPARATOR.split(_OVERSTRIKE.sub("", text)):
        lines = [line for line in fortune.splitlines() if not _ATTRIBUTION.match(line)]
        paragraphs = harvest.clean_docstring("\n".join(lines))
        if paragraphs:
            yield paragraphs


def python_doc_paragraphs(text: str) -> list[str]:
    """The prose paragraphs of one reST source of the Python manual."""
    return harvest.clean_docstring(_DESCRIPTION.sub("", text))


def _one_document(text: str) -> Iterator[list[str]]:
    yield python_doc_paragraphs(text)


def documents(files: list[Path], split: Callable[[str], Iterator[list[str]]]) -> Iterator[list[str]]:
    """The documents of ``files``, each split by ``split`` and cleaned by the harvest's filters."""
    seen = harvest.ParagraphSet()
    for path in files:
        for paragraphs in split(_read(path)):
            kept = seen.fresh(paragraphs)
            if kept:
                yield kept


Splitter = Callable[[str], Iterator[list[str]]]


def resolve(spec: str) -> tuple[str, Path, list[Path], Splitter, str]:
    """``fortunes[:DIR]`` or ``python-doc[:DIR]``: (name, directory, files, how a file splits into
    documents, description); a one-line :class:`GradzipError` when the package is not installed.
    The cache (:func:`gradzip.data.corpus.load_corpus`) builds the corpus from them."""
    name, _, given = spec.partition(":")
    if name == "fortunes":
        directory = Path(given or FORTUNES_DIR).expanduser()
        return (name, directory, fortune_files(directory), fortune_paragraphs,
                f"fortunes from {directory} (one fortune a document)")
    directory = Path(given or PYTHON_DOC_DIR).expanduser()
    return (name, directory, python_doc_files(directory), _one_document,
            f"the Python manual's prose from {directory / '_sources'} (one source file a document)")


def cache_key(name: str, directory: Path, files: list[Path], corpus_format: int) -> str:
    """The cache key: the source, this module's and the corpus format's versions, and every file
    read (path, size, mtime), so that an edited or upgraded package rebuilds the corpus."""
    h = hashlib.sha256(f"{name}{PROSE_FORMAT}.{corpus_format}.{harvest.HARVEST_VERSION}\n{directory.resolve()}\n"
                       .encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(directory)}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return h.hexdigest()
