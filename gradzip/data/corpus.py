"""Corpus sources, normalised once into a cached text file.

Every source becomes ``corpus.txt`` in its own cache directory: one sentence per line, a blank
line between documents (BERT's ``create_pretraining_data`` format). The tokenizer and the example
memmaps derived from it are cached in the same directory. Sources (:func:`load_corpus`):

- ``None``: the default corpus, English prose harvested from the documentation installed with
  Python and the project's dependencies (:mod:`gradzip.data.harvest`). No network.
- a text file or a directory of them: documents separated by blank lines, one sentence per line
  or free text (lines of a document are joined and re-split into sentences with a regex).
  WikiExtractor's ``<doc ...>``/``</doc>`` lines also separate documents. In a directory, files
  ending in .txt/.text/.md/.rst/.raw/.tokens or without suffix are text, .jsonl/.ndjson are JSONL;
  others and hidden files are ignored.
- a ``.jsonl`` file: one JSON object per line, its ``text`` field is one document.
- ``hf:NAME[:CONFIG[:SPLIT]]``: a Hugging Face dataset (needs ``datasets`` and the network, or
  its local cache). Each record's ``text`` is a document; for wikitext, documents are articles
  (split at `` = Title = `` lines).
- ``wordnet[:DIR]``: WordNet's glosses (:mod:`gradzip.data.wordnet`, ``apt-get install wordnet-base``).
- ``fortunes[:DIR]`` and ``python-doc[:DIR]``: the fortunes of Debian's ``fortunes`` and the prose
  of the Python manual from ``python3-doc``, cleaned with the default corpus's filters
  (:mod:`gradzip.data.prose`).

Cache keys: the default corpus by Python and package versions; files by path, size and mtime
(edit a file and it is re-read); ``wordnet``, ``fortunes`` and ``python-doc`` by the files they
read; HF datasets by name, config, split and ``datasets`` version.
Cache root: the ``cache_dir`` argument, else ``$GRADZIP_CACHE``, else ``$XDG_CACHE_HOME/gradzip``,
else ``~/.cache/gradzip``. Entries are built in a temporary directory and renamed into place, under
a file lock so that ranks starting together build once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gradzip.data import harvest
from gradzip.data.progress import progress_bar
from gradzip.errors import GradzipError
from gradzip.io import file_lock

CORPUS_FORMAT = 1
TEXT_SUFFIXES = {"", ".txt", ".text", ".md", ".rst", ".raw", ".tokens"}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}

_ABBREVIATIONS = {"e.g.", "i.e.", "etc.", "cf.", "vs.", "mr.", "mrs.", "ms.", "dr.", "prof.", "st.", "jr.", "sr.",
                  "fig.", "eq.", "no.", "vol.", "approx.", "resp.", "al.", "inc.", "ltd.", "co.", "ca.", "ch.", "sec."}
# A sentence ends at . ! or ? (plus closing quotes/brackets) followed by space and a capital,
# digit or opening quote/bracket.
_BOUNDARY = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
_WIKI_DOC = re.compile(r"^\s*</?doc(\s[^>]*)?>\s*$")
_WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")
_WIKITEXT_HEADING = re.compile(r"^ (=+) .* \1 ?$")


def progress_enabled(progress: bool) -> bool:
    """Progress bars unless disabled by the caller or by ``GRADZIP_NO_PROGRESS=1`` (tests, CI)."""
    return progress and not os.environ.get("GRADZIP_NO_PROGRESS")


def split_sentences(text: str) -> list[str]:
    """Split running text into sentences with a regex (no model): at ``.``/``!``/``?`` followed by
    whitespace and a capital, digit or opening quote; common abbreviations do not end a sentence."""
    text = " ".join(text.split())
    if not text:
        return []
    out: list[str] = []
    start = 0
    for m in _BOUNDARY.finditer(text):
        piece = text[start:m.start()]
        last = piece.rsplit(" ", 1)[-1].lower()
        if last in _ABBREVIATIONS or re.fullmatch(r"[a-z]\.", last):  # "e.g.", initials "J."
            continue
        out.append(text[start:m.end()].strip())
        start = m.end()
    out.append(text[start:].strip())
    return [s for s in out if s]


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The gradzip cache directory (see module docstring), created if needed."""
    if cache_dir is not None:
        root = Path(cache_dir)
    elif os.environ.get("GRADZIP_CACHE"):
        root = Path(os.environ["GRADZIP_CACHE"])
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]) / "gradzip"
    else:
        root = Path.home() / ".cache" / "gradzip"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GradzipError(f"cannot create cache directory {root}: {e.strerror}; set GRADZIP_CACHE to a writable "
                           f"directory") from None
    return root


def locked(path: Path) -> contextlib.AbstractContextManager[None]:
    """Exclusive inter-process lock on ``path`` (a lock file), so concurrent builders wait."""
    return file_lock(path)


@contextlib.contextmanager
def staging(final: Path) -> Iterator[Path]:
    """A temporary directory next to ``final`` that is renamed to ``final`` on success and removed
    on error, so that a cache entry is either complete or absent."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache entry is ordinary data
    try:
        yield tmp
        if final.exists():  # another builder won (no lock available): keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass(frozen=True)
class Corpus:
    """A normalised corpus in the cache: ``directory/corpus.txt`` plus ``meta.json``."""

    source: str
    directory: Path
    fingerprint: str  # sha256 of corpus.txt
    num_docs: int
    num_sentences: int
    num_bytes: int
    description: str

    @property
    def text_path(self) -> Path:
        return self.directory / "corpus.txt"

    def documents(self) -> Iterator[list[str]]:
        """Yield each document as its list of sentences."""
        doc: list[str] = []
        with open(self.text_path, encoding="utf-8") as fh:
            for line in fh:
                line = line.rstrip("\n")
                if line:
                    doc.append(line)
                elif doc:
                    yield doc
                    doc = []
        if doc:
            yield doc

    @classmethod
    def open(cls, directory: Path) -> Corpus:
        meta = json.loads((directory / "meta.json").read_text())
        return cls(meta["source"], directory, meta["fingerprint"], meta["num_docs"], meta["num_sentences"],
                   meta["num_bytes"], meta["description"])


def write_corpus(directory: Path, docs: Iterable[list[str]], source: str, description: str,
                 extra: dict | None = None) -> Corpus:
    """Write documents (lists of sentences or paragraphs, re-split here) as ``corpus.txt`` +
    ``meta.json`` into ``directory`` (a staging directory)."""
    t0 = time.perf_counter()
    digest = hashlib.sha256()
    n_docs = n_sent = n_bytes = 0
    with open(directory / "corpus.txt", "w", encoding="utf-8", newline="\n") as fh:
        for doc in docs:
            sentences = [s for chunk in doc for s in split_sentences(chunk)]
            if not sentences:
                continue
            block = "\n".join(sentences) + "\n\n"
            encoded = block.encode("utf-8")
            digest.update(encoded)
            fh.write(block)
            n_docs += 1
            n_sent += len(sentences)
            n_bytes += len(encoded)
    if n_docs == 0:
        raise GradzipError(f"corpus {source} contains no text; give files with at least one sentence")
    meta = dict(format=CORPUS_FORMAT, source=source, description=description, fingerprint=digest.hexdigest(),
                num_docs=n_docs, num_sentences=n_sent, num_bytes=n_bytes,
                build_s=round(time.perf_counter() - t0, 2), **(extra or {}))
    (directory / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return Corpus.open(directory)


# ----------------------------------------------------------------------------------------------
# Files and directories


def _utf8_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 file; a clear error for an unreadable file and for binary or
    undecodable content."""
    try:
        with open(path, "rb") as fh:
            if b"\0" in fh.read(8192):
                raise GradzipError(f"{path} is a binary file (it contains NUL bytes); give UTF-8 text, JSONL or a "
                                   f"directory of them")
            fh.seek(0)
            for lineno, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise GradzipError(f"{path} is not UTF-8 text (undecodable byte at line {lineno}, column "
                                       f"{e.start + 1}); convert it, e.g. iconv -f latin1 -t utf-8") from None
                yield lineno, line.lstrip("\ufeff") if lineno == 1 else line
    except OSError as e:  # unreadable (permissions), or the file system failed mid-read
        raise GradzipError(f"cannot read corpus file {path} ({e.strerror or type(e).__name__}); make it readable "
                           "or give another corpus") from None


def _text_documents(path: Path) -> Iterator[list[str]]:
    """Documents of a text file (blank-line separated)."""
    doc: list[str] = []
    for _, line in _utf8_lines(path):
        line = line.strip()
        if not line or _WIKI_DOC.match(line):
            if doc:
                yield [" ".join(doc)]
                doc = []
        else:
            doc.append(line)
    if doc:
        yield [" ".join(doc)]


def _jsonl_documents(path: Path) -> Iterator[list[str]]:
    """Documents of a JSONL file: the ``text`` field of each object."""
    for lineno, line in _utf8_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise GradzipError(f"{path}:{lineno}: not valid JSON ({e.msg}); JSONL needs one object per line") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise GradzipError(f"{path}:{lineno}: no string 'text' field; each JSONL line must be an object like "
                               f'{{"text": "..."}}')
        if obj["text"].strip():
            yield [para for para in re.split(r"\n\s*\n", obj["text"]) if para.strip()]


def corpus_files(root: Path) -> list[Path]:
    """The files a path corpus reads, sorted; errors for a missing path or no text files."""
    if not root.exists():
        raise GradzipError(f"corpus path {root} does not exist; give a text/JSONL file, a directory of them, "
                           f"hf:NAME, or nothing for the default corpus")
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise GradzipError(f"corpus path {root} is neither a file nor a directory")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            p = Path(dirpath, f)
            if not f.startswith(".") and p.suffix.lower() in TEXT_SUFFIXES | JSONL_SUFFIXES and p.is_file():
                files.append(p)
    files.sort()  # by path components: the corpus order does not depend on the file system
    if not files:
        raise GradzipError(f"directory {root} contains no text files (looked for *.txt, *.md, *.rst, *.jsonl "
                           f"and files without suffix)")
    return files


def _file_documents(files: list[Path], single: bool, progress: bool) -> Iterator[list[str]]:
    for path in progress_bar(files, desc="reading corpus", unit="file", disable=not progress or len(files) < 2):
        if path.stat().st_size == 0:
            if single:
                raise GradzipError(f"{path} is empty; give a file with text (documents separated by blank lines)")
            continue
        reader = _jsonl_documents if path.suffix.lower() in JSONL_SUFFIXES else _text_documents
        yielded = False
        for doc in reader(path):
            yielded = True
            yield doc
        if single and not yielded:
            raise GradzipError(f"{path} is empty (only whitespace or blank records); give a file with text")


def _path_key(root: Path, files: list[Path]) -> str:
    h = hashlib.sha256(f"corpus{CORPUS_FORMAT}\n{root.resolve()}\n".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(root) if f != root else f.name}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# Hugging Face datasets


def _hf_documents(name: str, config: str | None, split: str, records: Iterable[dict]) -> Iterator[list[str]]:
    """Documents from dataset records: wikitext articles, else one record = one document."""
    if "wikitext" in name:
        article: list[str] = []
        for r in records:
            line = r.get("text") or ""
            if _WIKITEXT_TITLE.match(line.rstrip("\n")):
                if article:
                    yield article
                article = []
            elif line.strip() and not _WIKITEXT_HEADING.match(line.rstrip("\n")):
                article.append(line.strip())
        if article:
            yield article
        return
    for r in records:
        text = r.get("text")
        if not isinstance(text, str):
            raise GradzipError(f"dataset {name} has no string 'text' column; choose a text dataset or save it as "
                               f"JSONL with a 'text' field")
        if text.strip():
            yield [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def _load_hf(spec: str, root: Path, progress: bool) -> Corpus:
    parts = spec[3:].split(":")
    if not parts[0] or len(parts) > 3:
        raise GradzipError(f"bad dataset spec {spec!r}; use hf:NAME[:CONFIG[:SPLIT]], e.g. "
                           f"hf:wikitext:wikitext-103-raw-v1")
    name, config, split = parts[0], (parts[1] if len(parts) > 1 else None) or None, (
        parts[2] if len(parts) > 2 else "train")
    try:
        import datasets
    except ImportError:
        raise GradzipError(f"corpus {spec} needs the `datasets` package: pip install 'gradzip[hf]' (or give a local "
                           f"text/JSONL corpus)") from None
    key = hashlib.sha256(f"hf{CORPUS_FORMAT}\n{name}\n{config}\n{split}\n{datasets.__version__}".encode()).hexdigest()
    final = root / "corpora" / f"hf-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{key[:12]}"
    with locked(root / "locks" / f"{final.name}.lock"):
        if (final / "meta.json").exists():
            return Corpus.open(final)
        try:
            ds = datasets.load_dataset(name, config, split=split)
        except Exception as e:  # offline, unknown name or config: datasets raises many types
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GradzipError(f"cannot load dataset {name!r} (config {config!r}, split {split!r}): {first[:200]}; "
                               f"check the name and the network, or use a local corpus") from None
        records = progress_bar(ds, desc=f"reading {name}", unit="rec", disable=not progress_enabled(progress))
        with staging(final) as tmp:
            return _finish(write_corpus(tmp, _hf_documents(name, config, split, records), spec,
                                        f"Hugging Face dataset {name} ({config or 'default'}, {split})"), final)


def _load_wordnet(spec: str, root: Path) -> Corpus:
    """``wordnet[:DIR]``: WordNet's glosses as English prose (:mod:`gradzip.data.wordnet`), without
    the glosses of the WordNet task's validation split."""
    from gradzip.data import wordnet  # the corpus module stays free of it for the harvest workers

    directory = wordnet.wordnet_dir(spec.partition(":")[2] or None)
    st = (directory / "data.noun").stat()
    key = hashlib.sha256(f"wordnet{CORPUS_FORMAT}\n{directory.resolve()}\n{st.st_size}\n{st.st_mtime_ns}\n"
                         f"{wordnet.VALIDATION_PERCENT}\n{wordnet.SYNSETS_PER_DOC}".encode()).hexdigest()
    final = root / "corpora" / f"wordnet-{key[:12]}"
    with locked(root / "locks" / f"{final.name}.lock"):
        if (final / "meta.json").exists():
            return Corpus.open(final)
        with staging(final) as tmp:
            return _finish(write_corpus(tmp, wordnet.corpus_documents(directory), spec,
                                        f"WordNet glosses from {directory} (the WordNet task's validation glosses "
                                        "left out)"), final)


def _load_prose(spec: str, root: Path) -> Corpus:
    """``fortunes[:DIR]``, ``python-doc[:DIR]``: Debian's fortunes or the Python manual's prose
    (:mod:`gradzip.data.prose`), cleaned with the harvest's filters."""
    from gradzip.data import prose  # only for these sources

    name, directory, files, split, description = prose.resolve(spec)
    final = root / "corpora" / f"{name}-{prose.cache_key(name, directory, files, CORPUS_FORMAT)[:12]}"
    with locked(root / "locks" / f"{final.name}.lock"):
        if not (final / "meta.json").exists():
            with staging(final) as tmp:
                write_corpus(tmp, prose.documents(files, split), spec, description)
        return Corpus.open(final)


def _finish(corpus: Corpus, final: Path) -> Corpus:
    """The corpus as it will be after the staging directory is renamed."""
    return Corpus(corpus.source, final, corpus.fingerprint, corpus.num_docs, corpus.num_sentences,
                  corpus.num_bytes, corpus.description)


# ----------------------------------------------------------------------------------------------


def load_corpus(spec: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None,
                progress: bool = True) -> Corpus:
    """The normalised, cached corpus for ``spec`` (None, a path, ``hf:NAME[:CONFIG[:SPLIT]]``,
    ``wordnet[:DIR]``, ``fortunes[:DIR]`` or ``python-doc[:DIR]``), built on first use. Bad input raises
    :class:`GradzipError` before anything is cached."""
    root = cache_root(cache_dir)
    progress = progress_enabled(progress)
    if spec is None or str(spec) in ("", "default"):
        return default_corpus(root, progress)
    if isinstance(spec, str) and spec.startswith("hf:"):
        return _load_hf(spec, root, progress)
    if isinstance(spec, str) and (spec == "wordnet" or spec.startswith("wordnet:")):
        return _load_wordnet(spec, root)
    if isinstance(spec, str) and spec.split(":", 1)[0] in ("fortunes", "python-doc"):
        return _load_prose(spec, root)
    path = Path(spec).expanduser()
    files = corpus_files(path)
    key = _path_key(path, files)
    final = root / "corpora" / f"path-{re.sub(r'[^A-Za-z0-9_.-]', '_', path.resolve().name)[:40]}-{key[:12]}"
    with locked(root / "locks" / f"{final.name}.lock"):
        if (final / "meta.json").exists():
            return Corpus.open(final)
        with staging(final) as tmp:
            docs = _file_documents(files, single=path.is_file(), progress=progress)
            return _finish(write_corpus(tmp, docs, str(path.resolve()), f"files under {path.resolve()}"), final)


def default_corpus(root: Path, progress: bool = True) -> Corpus:
    """The default corpus (see :mod:`gradzip.data.harvest`), harvested once per environment."""
    key = harvest.environment_key()
    final = root / "corpora" / f"default-{key[:12]}"
    with locked(root / "locks" / f"{final.name}.lock"):
        if (final / "meta.json").exists():
            return Corpus.open(final)
        with staging(final) as tmp:
            roots = ", ".join(label for label, _ in harvest.source_roots())
            corpus = write_corpus(tmp, harvest.harvest(progress), "default",
                                  f"default corpus: docstrings, comments and pydoc topics of {roots}",
                                  extra=dict(environment_key=key))
            return _finish(corpus, final)
