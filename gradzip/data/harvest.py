"""The default corpus: English prose harvested from documentation installed on this machine.

No network, no download. Sources, in this order (absent packages are skipped):

1. the Python standard library's ``.py`` modules (``test``/``tests`` and ``site-packages``
   excluded);
2. numpy, scipy, matplotlib, torch, tokenizers and tqdm, and the runtime dependencies they
   install (sympy, mpmath, networkx, jinja2, fsspec, filelock, fontTools, Pillow, pyparsing,
   dateutil, packaging, huggingface_hub);
3. the language-reference topics of ``pydoc`` (``pydoc_data.topics``).

From every source file of 1 and 2 it takes the docstrings (module, class, function), the
documentation strings attached at import time with ``add_newdoc(...)`` / ``add_docstr(...)``
(numpy's and torch's reference docs for C functions live there), and the full-line ``#`` comment
blocks (developers' explanations; commented-out code fails the prose filter).

Source files are parsed with :mod:`ast`, never imported (importing thousands of modules is slow
and has side effects). Every docstring is cleaned to prose: doctests, literal/code blocks, rST
directives, section headers, parameter-spec lines, tables and symbol-heavy lines are dropped, rST
markup is reduced to its text, and paragraphs that are not English sentences (too short, too few
plain words, too few function words) or look like licence text are discarded. Paragraphs are
de-duplicated across the corpus (docstrings are copied between overloads and subclasses).

A document is the docstrings of one source file (module, classes, functions, in source order),
or the comments of one file, so consecutive sentences of a document are about the same module:
that is what next-sentence prediction needs. (One docstring per document would be more coherent
but too short: most are a sentence or two, and examples would be mostly padding at 128 tokens.) The content is
deterministic for a given Python and set of package versions (files are visited in sorted order).
"""

from __future__ import annotations

import ast
import gc
import hashlib
import importlib.util
import inspect
import os
import re
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from gradzip.data.progress import progress_bar

HARVEST_VERSION = 2
PACKAGES = ("numpy", "scipy", "matplotlib", "torch", "tokenizers", "tqdm",
            # their runtime dependencies (importable names), for volume: docstrings alone of the
            # six above give ~7 MB of prose, short of the 10 MB the default corpus promises
            "sympy", "mpmath", "networkx", "jinja2", "fsspec", "filelock", "fontTools", "PIL", "pyparsing",
            "dateutil", "packaging", "huggingface_hub")
DISTRIBUTIONS = {"fontTools": "fonttools", "PIL": "pillow", "dateutil": "python-dateutil",
                 "huggingface_hub": "huggingface-hub"}
# Calls whose string argument is a docstring attached at import time.
DOC_CALLS = {"add_newdoc", "add_docstr", "_add_docstr", "add_newdoc_ufunc", "_add_newdoc_ufunc", "add_doc"}
SKIP_DIRS = {"test", "tests", "testing", "site-packages", "__pycache__", "idlelib", "turtledemo", "_vendor",
             "vendored", "benchmarks"}

_UNDERLINE = re.compile(r"^([-=~^*#+`'\"])\1{2,}\s*$")
_HEADER = re.compile(r"^[A-Z][A-Za-z ]{0,30}:{1,2}$")  # "Args:", "Returns:", "Example::"
_DIRECTIVE = re.compile(r"^\.\.\s+([\w-]+)::\s*(.*)$")
_PROSE_DIRECTIVES = {"note", "warning", "tip", "important", "hint", "caution", "attention", "danger",
                     "versionadded", "versionchanged", "deprecated", "admonition", "seealso"}
# "x : array_like, optional" (numpy) / "x (Tensor): the input" (Google) / ":param x: the input"
_PARAM = re.compile(r"^(?::\w+(?:\s+[\w.\[\], ]+)?:"  # :param x:
                    r"|\*{0,2}[\w.]+(?:\s*,\s*\*{0,2}[\w.]+)*\s*(?:\([^)]*\))?\s*:)"  # x, y (type):
                    r"(?:\s+(.*))?$")
_ROLE = re.compile(r":[\w:+.-]+:`~?([^`<]*?)(?:\s*<[^`>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]*>`_{1,2}")
_LITERAL = re.compile(r"``([^`]+)``|`([^`]+)`_{0,2}")
_EMPH = re.compile(r"\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*")
_URL = re.compile(r"https?://\S+|www\.\S+")
_CITE = re.compile(r"\s*\[[\w#*-]+\]_")
_PLAIN = re.compile(r"^[(\"']?[A-Za-z][a-z]*(?:[-'][A-Za-z]+)*[.,;:!?)\"']*$")
_FUNCTION_WORDS = {"the", "a", "an", "is", "are", "of", "to", "and", "in", "for", "this", "that", "be", "with",
                   "it", "as", "by", "or", "if", "on", "not", "can", "will", "which", "from", "when"}
_NON_LETTERS = re.compile(r"[^A-Za-z]+")
_SYMBOLS = re.compile(r"[^A-Za-z0-9\s.,;:'\"()`*-]")
_LICENCE = re.compile(r"\b(copyright|licen[cs]e[ds]?|all rights reserved|warrant(y|ies)|merchantability)\b", re.I)


def source_roots() -> list[tuple[str, Path]]:
    """(label, directory) of every source tree harvested, stdlib first."""
    roots = [("python-stdlib", Path(sysconfig.get_paths()["stdlib"]))]
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.submodule_search_locations:
            roots.append((name, Path(spec.origin).parent))
    return roots


def environment_key() -> str:
    """Identifies the installed environment the corpus is harvested from (cache key)."""
    from importlib.metadata import PackageNotFoundError, version

    parts = [f"harvest{HARVEST_VERSION}", sys.version]
    for name in PACKAGES:
        try:
            parts.append(f"{name}=={version(DISTRIBUTIONS.get(name, name))}")
        except PackageNotFoundError:
            parts.append(f"{name}:absent")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def source_files(root: Path) -> list[Path]:
    """The ``.py`` files under ``root`` in a deterministic (sorted) order."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        out.extend(Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py") and not f.startswith("test_"))
    return out


def docstrings(source: bytes) -> list[str]:
    """Docstrings of the module, its classes and functions, and strings given to ``add_newdoc``-like
    calls made as statements, in source order. Unparsable files give nothing."""
    enabled = gc.isenabled()
    gc.disable()  # ASTs have no reference cycles; collections while building one cost ~20% of the time
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    finally:
        if enabled:
            gc.enable()
    found: list[str] = []
    _collect(tree, found)
    return found


def _collect(node: ast.AST, found: list[str]) -> None:
    # Statements only: descending into expressions (most of the tree) would triple the time.
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node, clean=True)
        if doc:
            found.append(doc)
    for field in ("body", "orelse", "finalbody", "handlers", "cases"):
        for child in getattr(node, field, ()):
            if isinstance(child, ast.Expr) and isinstance(child.value, ast.Call):
                _doc_call(child.value, found)
            elif isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
                _collect(child, found)


def _doc_call(call: ast.Call, found: list[str]) -> None:
    f = call.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    if name in DOC_CALLS:
        for arg in call.args:
            s = _string_of(arg)
            if s and len(s) > 80:
                found.append(inspect.cleandoc(s))


_COMMENT = re.compile(rb"^[ \t]*#[ \t]?(.*?)[ \t]*$", re.M)
_COMMENT_SKIP = (b"!", b"-*-", b"type:", b"noqa", b"pragma", b"fmt:", b"pylint:", b"mypy:", b"ruff:")


def comments(source: bytes) -> str:
    """The full-line ``#`` comments of a source file; comment blocks are separated by blank lines,
    so each block becomes a paragraph for :func:`clean_docstring`."""
    out: list[str] = []
    end = -1
    for m in _COMMENT.finditer(source):
        text = m.group(1)
        if text.startswith(_COMMENT_SKIP):
            continue
        if m.start() != end + 1 and out:  # not on the line right after the previous comment
            out.append("")
        out.append(text.decode("utf-8", "replace"))
        end = m.end()
    return "\n".join(out)


def _string_of(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Tuple) and len(node.elts) == 2:  # add_newdoc(mod, name, (attr, doc))
        return _string_of(node.elts[1])
    return None


def _markup_to_text(text: str) -> str:
    text = _URL.sub("", text)
    text = _CITE.sub("", text)
    text = _ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1] if m.group(0).count("~") else m.group(1), text)
    text = _LINK.sub(r"\1", text)
    text = _LITERAL.sub(lambda m: m.group(1) or m.group(2), text)
    text = _EMPH.sub(lambda m: m.group(1) or m.group(2), text)
    text = text.replace("|", " ")
    return re.sub(r"\s+", " ", text).strip()


def is_prose(paragraph: str) -> bool:
    """True for an English paragraph of at least one real sentence (not code, maths or licence)."""
    tokens = paragraph.split()
    if len(tokens) < 8 or _LICENCE.search(paragraph):
        return False
    plain = sum(1 for t in tokens if _PLAIN.match(t))
    if plain < 0.75 * len(tokens):
        return False
    function_words = sum(1 for t in tokens if t.lower().strip(".,;:!?()\"'") in _FUNCTION_WORDS)
    if function_words < max(2, 0.1 * len(tokens)):
        return False
    letters = len(_NON_LETTERS.sub("", paragraph))
    return letters >= 0.7 * len(paragraph.replace(" ", "")) and paragraph.rstrip()[-1:] in ".!?:)\"'"


def _symbol_heavy(line: str) -> bool:
    symbols = len(_SYMBOLS.findall(line))
    return symbols > 0.15 * len(line.replace(" ", "")) or line.rstrip().endswith(("{", "[", "(", "\\", ","))


def clean_docstring(text: str, indented_code: bool = False) -> list[str]:
    """Prose paragraphs of one docstring (see the module docstring for the rules).

    ``indented_code``: treat paragraphs indented deeper than the text as code (pydoc topics are
    rendered text in which code blocks are only indented, with no ``::`` marker)."""
    paragraphs: list[str] = []
    cur: list[str] = []
    skip_indent: int | None = None  # inside a literal block / directive body indented deeper than this
    in_doctest = False

    def flush() -> None:
        if cur:
            paragraphs.append(" ".join(cur))
            cur.clear()

    for raw in text.expandtabs().splitlines():
        line = raw.strip()
        indent = len(raw) - len(raw.lstrip())
        if skip_indent is not None:
            if not line or indent > skip_indent:
                continue
            skip_indent = None
        if in_doctest:
            if line:
                continue  # doctest output lines run until a blank line
            in_doctest = False
        if not line:
            flush()
            continue
        if indented_code and indent >= 3 and not cur:
            skip_indent = indent - 1
            continue
        if line.startswith((">>>", "... ", "$ ", "In [")):
            flush()
            in_doctest = True
            continue
        if _UNDERLINE.match(line):
            if cur:
                cur.pop()  # the section title above the underline
            flush()
            continue
        m = _DIRECTIVE.match(line)
        if m or line.startswith(".."):
            flush()
            if m and m.group(1) in _PROSE_DIRECTIVES:
                if m.group(2):
                    cur.append(m.group(2))
            else:
                skip_indent = indent
            continue
        if _HEADER.match(line):
            flush()
            if line.endswith("::"):
                skip_indent = indent
            continue
        if line.endswith("::"):
            cur.append(line[:-1])
            flush()
            skip_indent = indent
            continue
        p = _PARAM.match(line)
        if p and len(line.split()) <= 12:
            flush()
            rest = p.group(1) or ""
            if len(rest.split()) >= 4:
                cur.append(rest)
            continue
        if _symbol_heavy(line) or line.startswith(("- ", "* ", "+ ", "#")) and len(line.split()) < 4:
            flush()
            continue
        cur.append(line.lstrip("-*+ ") if line[:2] in ("- ", "* ", "+ ") else line)
    flush()
    out = []
    for para in paragraphs:
        para = _markup_to_text(para)
        if is_prose(para):
            out.append(para)
    return out


def pydoc_topics() -> list[str]:
    """The language-reference topics of the ``pydoc`` help system, in sorted order."""
    try:  # some distributions package pydoc_data separately
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [topics[k] for k in sorted(topics)]


def file_paragraphs(path: Path) -> tuple[list[str], list[str]]:
    """Prose paragraphs of one source file: (from its docstrings, from its comments)."""
    try:
        source = path.read_bytes()
    except OSError:
        return [], []
    return [p for doc in docstrings(source) for p in clean_docstring(doc)], clean_docstring(comments(source))


class ParagraphSet:
    """The paragraphs a corpus has taken so far, compared without case, for de-duplication."""

    def __init__(self) -> None:
        self._seen: set[bytes] = set()

    def fresh(self, paragraphs: list[str]) -> list[str]:
        """``paragraphs`` less those seen before (in this call or an earlier one), in order; the
        rest are recorded as seen."""
        kept = []
        for p in paragraphs:
            h = hashlib.blake2b(p.lower().encode(), digest_size=12).digest()
            if h not in self._seen:
                self._seen.add(h)
                kept.append(p)
        return kept


def harvest(progress: bool = True) -> Iterator[list[str]]:
    """Yield documents (lists of prose paragraphs) of the default corpus, de-duplicated.

    Serial on purpose: a process pool would have to spawn (the caller may hold torch's threads,
    so no fork), and spawning re-runs the caller's ``__main__``, which breaks scripts without a
    main guard, notebooks and stdin. The build is ~30 s of CPU once per environment."""
    files = [f for _, root in source_roots() for f in source_files(root)]
    fresh = ParagraphSet().fresh

    bar = progress_bar(map(file_paragraphs, files), total=len(files), desc="harvesting docs for the default corpus",
                       unit="file", disable=not progress, mininterval=0.5)
    for from_docs, from_comments in bar:
        for paragraphs in (fresh(from_docs), fresh(from_comments)):
            if paragraphs:
                yield paragraphs
    for topic in pydoc_topics():
        paragraphs = fresh(clean_docstring(topic, indented_code=True))
        if paragraphs:
            yield paragraphs
