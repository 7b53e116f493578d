"""The README and the manual (``docs/``, a MkDocs site built from ``mkdocs.yml``) say what the code does.

- The site builds with ``mkdocs build --strict``: no broken link or anchor, no page left out of
  the ``nav`` (skipped, with the reason, where MkDocs is not installed).
- Every command of every ``bash`` block of ``README.md``, ``docs/**/*.md`` and the files they
  include (``--8<-- "BENCHMARKS.md"``) is classified by the rule below, and

  * the **cheap** ones run, each as ``python -m gradzip ARGS`` (all of them in one child process,
    which imports torch once), and must exit 0. Cheap: any command with ``--help``, ``-h`` or
    ``--version``; ``gradzip ls``, ``env``, ``simulate``; ``gradzip run`` with ``--list``, ``--show``
    or ``--dry-run``; ``gradzip sweep`` with ``--dry-run``; ``gradzip bench compress`` with an
    explicit ``--numel`` of at most 2**20. A command holding the placeholder ``...`` never runs;
  * every gradzip command, run or not, is **parsed**: its flags through ``gradzip.cli.build_parser``
    (``python -m gradzip.X`` modules through their own ``main``, stopped right after parsing);
    ``gradzip train`` flags also through the strict ``TrainConfig`` validation; ``gradzip run NAME``
    must name a shipped spec. Expensive commands (training, sweeps, whole specs, plots, benchmarks,
    ``gradzip netem``, which needs root, and anything under torchrun/mpirun/mpiexec/srun) are
    only parsed, and the reason is given in ``why_not_run``;
  * commands that are not gradzip's (venv, pip, pytest, ruff, mkdocs, ``ip netns exec``, rm,
    ``python -c``) are recognised by ``EXTERNAL`` and left alone; an unrecognised command fails.
- ``toml`` blocks are valid specs or training configs; ``<!-- file: NAME -->`` before a block writes
  it to NAME in the directory the commands run and parse in.
- ``python`` blocks compile and their gradzip imports resolve; ``<!-- source: PATH -->`` before a
  block makes it a copy of PATH: its lines, in order (a line ``...`` stands for lines left out).
- Every module name (``gradzip.training.loop``) and repository path (``gradzip/cluster/...``) the
  pages mention exists.

The rule is also described in docs/development.md ("These pages").
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SNIPPET = re.compile(r'^--8<--\s+"([^"]+)"\s*$', re.M)
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"^<!--\s*(file|source):\s*(\S+)\s*-->\s*$")


# ------------------------------------------------------------------------------ the pages
def _pages() -> list[Path]:
    pages = [README, *sorted((REPO / "docs").rglob("*.md"))]
    for page in list(pages):  # files included into a page (pymdownx.snippets, base path: the repo root)
        for name in SNIPPET.findall(page.read_text(encoding="utf-8")):
            if (REPO / name) not in pages:
                pages.append(REPO / name)
    return pages


PAGES = _pages()


@dataclass
class Block:
    where: str  # "docs/training.md:12": the line of the opening fence
    lang: str
    code: str
    line: int  # line of the code's first line in the page
    marker: tuple[str, str] | None  # ("file" | "source", path) from the comment just above the fence


def _blocks() -> list[Block]:
    out = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        rel = page.relative_to(REPO).as_posix()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            above = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mk = MARKER.match(above.strip())
            out.append(Block(f"{rel}:{line}", m.group(1), m.group(2), line + 1, (mk[1], mk[2]) if mk else None))
    return out


BLOCKS = _blocks()


def _ids(items: list) -> list[str]:
    return [i.where for i in items]


# ------------------------------------------------------------------------------ commands
@dataclass
class Command:
    where: str
    text: str  # as written (continuation lines joined)
    tokens: list[str]  # one simple command: no env assignments, wrappers or redirections
    env: dict[str, str]


def _logical_lines(block: Block) -> list[tuple[int, str]]:
    lines, buf, start = [], "", 0
    for i, raw in enumerate(block.code.splitlines()):
        if not buf:
            start = block.line + i
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        buf += raw
        if buf.strip() and not buf.strip().startswith("#"):
            lines.append((start, buf.strip()))
        buf = ""
    return lines


def _split(text: str) -> list[list[str]]:
    """Simple commands of a shell line: split at && || ; | &, redirections and comments dropped."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    parts: list[list[str]] = [[]]
    toks = list(lex)
    i = 0
    while i < len(toks):
        t = toks[i]
        if t in ("&&", "||", ";", "|", "&"):
            parts.append([])
        elif t in (">", ">>", "<", ">&"):
            i += 1  # and its target
        else:
            parts[-1].append(t)
        i += 1
    return [p for p in parts if p]


ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _unwrap(toks: list[str]) -> tuple[list[str], dict[str, str]]:
    """Leading ``VAR=value`` assignments and ``/usr/bin/time [-f FMT]`` removed."""
    env = {}
    while toks and ENV_ASSIGNMENT.match(toks[0]):
        k, v = toks[0].split("=", 1)
        env[k] = v
        toks = toks[1:]
    if toks and Path(toks[0]).name == "time":
        toks = toks[1:]
        while toks and toks[0] in ("-f", "-o", "--format", "--output"):
            toks = toks[2:]
    return toks, env


def _commands() -> list[Command]:
    out = []
    for b in BLOCKS:
        if b.lang not in ("bash", "sh", "shell", "console"):
            continue
        page = b.where.rsplit(":", 1)[0]
        for line, text in _logical_lines(b):
            for toks in _split(text):
                toks, env = _unwrap(toks)
                if toks:
                    out.append(Command(f"{page}:{line}", text, toks, env))
    # Several simple commands on one line (a && b) get distinct ids.
    seen: dict[str, int] = {}
    for c in out:
        seen[c.where] = seen.get(c.where, 0) + 1
        if seen[c.where] > 1:
            c.where += f"#{seen[c.where]}"
    return out


COMMANDS = _commands()

PYTHON = re.compile(r"(^|/)python(3(\.\d+)?)?$")
GRADZIP_EXE = re.compile(r"(^|/)gradzip$")
LAUNCHERS = ("torchrun", "mpirun", "mpiexec", "srun")


def _is_python(t: list[str], *args: str) -> bool:
    return bool(PYTHON.search(t[0])) and t[1:1 + len(args)] == list(args)


# Commands that are not gradzip's: never run here, and nothing of gradzip's to parse.
EXTERNAL: list[tuple[Callable[[list[str]], bool], str]] = [
    (lambda t: _is_python(t, "-m", "venv"), "creates a virtual environment"),
    (lambda t: Path(t[0]).name in ("pip", "pip3") or _is_python(t, "-m", "pip"), "installs packages"),
    (lambda t: _is_python(t, "-m", "pytest") or Path(t[0]).name == "pytest", "runs the test suite itself"),
    (lambda t: Path(t[0]).name == "ruff", "the linter"),
    (lambda t: Path(t[0]).name == "mkdocs", "builds these pages (test_mkdocs_build_strict does)"),
    (lambda t: t[:3] == ["ip", "netns", "exec"], "needs root: a program on a host of the network testbed"),
    (lambda t: t[0] == "rm", "removes files"),
    (lambda t: Path(t[0]).name in ("tensorboard", "wandb", "mlflow"), "a logger's own viewer or uploader"),
    (lambda t: _is_python(t, "-c"), "inline Python (test_inline_python_compiles checks it)"),
    (lambda t: any(x.startswith("examples/") and x.endswith(".py") for x in t),
     "an example script (tests/test_integrations.py runs each under its launcher)"),
]


@dataclass
class Invocation:
    """A gradzip program in a command: ``module`` is "gradzip" (the CLI) or ``gradzip.X``."""

    where: str
    text: str
    module: str
    argv: list[str]
    launcher: str | None
    env: dict[str, str]


def _gradzip_at(t: list[str]) -> tuple[str, list[str]] | None:
    if GRADZIP_EXE.search(t[0]):
        return "gradzip", t[1:]
    rest = t[1:] if PYTHON.search(t[0]) else t
    while rest[:2] == ["-m", "mpi4py"]:
        rest = rest[2:]
    if len(rest) >= 2 and rest[0] == "-m" and (rest[1] == "gradzip" or rest[1].startswith("gradzip.")):
        return rest[1], rest[2:]
    return None


def classify(c: Command) -> Invocation | str:
    """The gradzip invocation of a command, or why it is not gradzip's; raises if unrecognised."""
    t = c.tokens
    launcher = Path(t[0]).name if Path(t[0]).name in LAUNCHERS else None
    if launcher:
        for i in range(1, len(t)):
            if (PYTHON.search(t[i]) or GRADZIP_EXE.search(t[i]) or t[i] == "-m") and (found := _gradzip_at(t[i:])):
                return Invocation(c.where, c.text, found[0], found[1], launcher, c.env)
    elif found := _gradzip_at(t):
        return Invocation(c.where, c.text, found[0], found[1], None, c.env)
    for matches, reason in EXTERNAL:
        if matches(t):
            return reason
    raise AssertionError(f"{c.where}: unrecognised command {c.text!r}: classify it in tests/test_docs.py "
                         "(EXTERNAL for other programs' commands)")


EXPENSIVE = {
    "train": "trains a model",
    "sweep": "runs every cell of a spec",
    "run": "runs a whole shipped spec (minutes)",
    "plot": "needs the directory of a finished run",
    "bench": "a benchmark (minutes)",
    "netem": "needs root (network namespaces, tc)",
}


def why_not_run(inv: Invocation) -> str | None:
    """None if the command is cheap enough to run here (see the module docstring), else why not."""
    a = inv.argv
    if inv.launcher:
        return f"starts several ranks under {inv.launcher}"
    if "..." in a:
        return "holds a placeholder (...)"
    if {"--help", "-h", "--version"} & set(a):
        return None
    if inv.module != "gradzip":
        return f"{inv.module} is not on the list of cheap commands (root or several ranks)"
    sub = a[0] if a else ""
    if sub in ("ls", "env", "simulate"):
        return None
    if sub == "run" and {"--list", "--show", "--dry-run"} & set(a):
        return None
    if sub == "sweep" and "--dry-run" in a:
        return None
    if a[:2] == ["bench", "compress"] and "--numel" in a and int(a[a.index("--numel") + 1]) <= 2**20:
        return None
    return EXPENSIVE.get(sub, "not on the list of cheap commands")


def _invocations() -> tuple[list[Invocation], list[tuple[Command, str]]]:
    gz, other = [], []
    for c in COMMANDS:
        try:
            r = classify(c)
        except AssertionError:
            continue  # reported by test_every_command_is_recognised
        (gz.append(r) if isinstance(r, Invocation) else other.append((c, r)))
    return gz, other


INVOCATIONS, NOT_GRADZIP = _invocations()
RUN = [i for i in INVOCATIONS if why_not_run(i) is None]


def test_every_command_is_recognised():
    assert COMMANDS and INVOCATIONS and RUN
    for c in COMMANDS:
        classify(c)


# ------------------------------------------------------------------------------ files the pages show
@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Where the commands run and parse: holds every block marked ``<!-- file: NAME -->``."""
    d = tmp_path_factory.mktemp("docs-commands")
    for b in BLOCKS:
        if b.marker and b.marker[0] == "file":
            path = d / b.marker[1]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(b.code, encoding="utf-8")
    return d


# ------------------------------------------------------------------------------ (b) running
DRIVER = r"""
import contextlib, io, json, os, runpy, sys
todo_path, done_path = sys.argv[1:3]
todo = json.load(open(todo_path))
done = []
for item in todo:
    buf, saved = io.StringIO(), dict(os.environ)
    os.environ.update(item["env"])
    sys.argv = ["gradzip", *item["argv"]]
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            runpy.run_module("gradzip", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:  # report it as this command's failure, go on with the next
            code = f"{type(e).__name__}: {e}"
    os.environ.clear()
    os.environ.update(saved)
    done.append({"code": code, "output": buf.getvalue()[-4000:]})
json.dump(done, open(done_path, "w"))
"""


@pytest.fixture(scope="module")
def ran(workdir) -> dict[str, dict]:
    """Every cheap command, run as ``python -m gradzip ARGS`` in one child process."""
    todo = workdir / "commands.json"
    todo.write_text(json.dumps([{"argv": i.argv, "env": i.env} for i in RUN]))
    result = workdir / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "GRADZIP_NO_PROGRESS": "1"}
    p = subprocess.run([sys.executable, "-c", DRIVER, str(todo), str(result)], cwd=workdir, env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    return dict(zip(_ids(RUN), json.loads(result.read_text())))


@pytest.mark.parametrize("inv", RUN, ids=_ids(RUN))
def test_cheap_command_runs(inv, ran):
    r = ran[inv.where]
    assert r["code"] == 0, f"{inv.where}: `{inv.text}` exited {r['code']}:\n{r['output']}"


# ------------------------------------------------------------------------------ (c) parsing
class _Parsed(Exception):
    pass


@pytest.mark.filterwarnings("ignore:randomk. unbiased=true")  # shipped specs show what happens with it
@pytest.mark.parametrize("inv", INVOCATIONS, ids=_ids(INVOCATIONS))
def test_command_parses(inv, workdir, monkeypatch):
    from gradzip.errors import GradzipError

    monkeypatch.chdir(workdir)
    argv = [a for a in inv.argv if a != "..."]
    what = f"{inv.where}: `{inv.text}`"
    if inv.module != "gradzip":  # a module's own parser: stop its main() right after parsing
        parse = argparse.ArgumentParser.parse_args

        def parse_and_stop(self, args=None, namespace=None):
            parse(self, args, namespace)
            raise _Parsed

        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
        try:
            importlib.import_module(inv.module).main(argv)
        except _Parsed:
            return
        except SystemExit as e:
            assert e.code in (0, None), f"{what}: {inv.module} rejects these arguments"
            return
        pytest.fail(f"{what}: {inv.module}.main() returned without parsing its arguments")

    from gradzip.cli import build_parser

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        assert e.code in (0, None), f"{what}: gradzip's argument parser rejects it"
        return
    try:
        if args.command == "train":
            from gradzip.training.cli import config_from_args

            config_from_args(args)
        elif args.command == "run" and args.name:
            from gradzip.experiments.run_cli import load_shipped

            load_shipped(args.name)
        elif args.command == "sweep" and Path(args.spec).is_file():
            from gradzip.experiments.spec import load_spec

            load_spec(args.spec)
    except GradzipError as e:
        pytest.fail(f"{what}: {e}")


# ------------------------------------------------------------------------------ other blocks
TOMLS = [b for b in BLOCKS if b.lang == "toml"]
PYTHONS = [b for b in BLOCKS if b.lang == "python"]
COPIES = [b for b in BLOCKS if b.marker and b.marker[0] == "source"]
INLINE = [c for c, _ in NOT_GRADZIP if _is_python(c.tokens, "-c")]


@pytest.mark.parametrize("block", TOMLS, ids=_ids(TOMLS))
def test_toml_block_is_a_valid_spec_or_config(block):
    from gradzip.errors import GradzipError
    from gradzip.experiments.spec import parse_spec
    from gradzip.training.config import TrainConfig

    data = tomllib.loads(block.code)
    name = Path(block.marker[1] if block.marker else "docs-block.toml")
    try:
        if "base" in data or "grid" in data:
            parse_spec(data, name)
        else:
            TrainConfig.from_dict(data, source=str(name))
    except GradzipError as e:
        pytest.fail(f"{block.where}: {e}")


def _check_python(code: str, where: str) -> None:
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        pytest.fail(f"{where}: {e}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gradzip":
            mod = importlib.import_module(node.module)
            missing = [a.name for a in node.names if not hasattr(mod, a.name)
                       and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
            assert not missing, f"{where}: {node.module} has no {missing}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "gradzip":
                    importlib.import_module(a.name)


@pytest.mark.parametrize("block", PYTHONS, ids=_ids(PYTHONS))
def test_python_block_compiles_and_its_imports_resolve(block):
    _check_python(block.code, block.where)


@pytest.mark.parametrize("cmd", INLINE, ids=_ids(INLINE))
def test_inline_python_compiles(cmd):
    _check_python(cmd.tokens[2], cmd.where)


@pytest.mark.parametrize("block", COPIES, ids=_ids(COPIES))
def test_copied_code_matches_its_source(block):
    source = REPO / block.marker[1]
    assert source.is_file(), f"{block.where}: {block.marker[1]} does not exist"
    lines = [s.strip() for s in source.read_text(encoding="utf-8").splitlines()]
    at = 0
    for line in block.code.splitlines():
        s = line.strip()
        if not s or s == "...":
            continue
        try:
            at = lines.index(s, at) + 1
        except ValueError:
            pytest.fail(f"{block.where}: {block.marker[1]} has no line {s!r} after its line {at}: "
                        "copy the code again")


def test_pytest_commands_use_registered_markers_and_known_options(pytestconfig):
    """The stress command and friends: ``-m MARK`` is a registered marker, ``--opt`` a known option
    (``--count`` needs pytest-repeat)."""
    markers = {m.split(":")[0].split("(")[0].strip() for m in pytestconfig.getini("markers")}
    for c, _ in NOT_GRADZIP:
        t = c.tokens
        if not (_is_python(t, "-m", "pytest") or Path(t[0]).name == "pytest"):
            continue
        args = t[3:] if _is_python(t, "-m", "pytest") else t[1:]
        for i, a in enumerate(args):
            if a == "-m":  # a marker expression: every name in it is registered
                names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", args[i + 1])) - {"and", "or", "not"}
                assert names <= markers, f"{c.where}: marker(s) {names - markers} not registered in pyproject.toml"
            elif a.startswith("--"):
                try:
                    pytestconfig.getoption(a[2:].split("=")[0].replace("-", "_"))
                except ValueError:
                    pytest.fail(f"{c.where}: pytest has no option {a} here (a plugin missing from the dev extra?)")


def _projection() -> tuple[Block, list[list[str]]]:
    """The projection command of docs/simulator.md and the rows of the table that follows it."""
    page = REPO / "docs" / "simulator.md"
    block = next(b for b in BLOCKS if b.where.startswith("docs/simulator.md") and "--tokens 16.75e9" in b.code
                 and "--compressor none" in b.code)
    after = page.read_text(encoding="utf-8").split(block.code, 1)[1]
    rows = [[c.strip().strip("`") for c in line.strip().strip("|").split("|")]
            for line in after.splitlines() if line.startswith("| `")]
    return block, rows


@pytest.mark.filterwarnings("ignore:randomk. unbiased=true")
def test_projection_table_is_what_the_simulator_prints(capsys):
    """docs/simulator.md's table: the projection command's numbers, at overlap 0 and (last column) 1."""
    import warnings

    from gradzip.cli import main

    block, rows = _projection()
    (_, text), = _logical_lines(block)
    argv = _split(text)[0][1:]
    results = {}
    fmt = warnings.formatwarning
    try:
        for overlap in ("0", "1"):
            assert main([*argv, "--overlap", overlap, "--json"]) == 0
            results[overlap] = {r["compressor"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    finally:
        warnings.formatwarning = fmt
    from gradzip.compress import create

    assert len(rows) == argv.count("--compressor"), f"{block.where}: one table row per --compressor"
    for spec, payload, collective, comm, step, tps, eff, days0, days1 in rows:
        c = create(spec)
        r, r1 = results["0"][c.spec], results["1"][c.spec]
        want = [f"{r['payload_bytes'] / 1e6:,.1f} MB", c.exchange + (f" ×{c.rounds}" if c.rounds > 1 else ""),
                f"{r['comm_s'] * 1e3:,.0f} ms", f"{r['step_s'] * 1e3:,.0f} ms", f"{r['tokens_per_s']:,.0f}",
                f"{r['scaling_efficiency']:.0%}", f"{r['days']:.1f}", f"{r1['days']:.1f}"]
        got = [payload, collective, comm, step, tps, eff, days0, days1]
        assert got == want, f"docs/simulator.md, row {spec}: the simulator now says {want}; update the table"


# ------------------------------------------------------------------------------ names and paths
DOTTED = re.compile(r"(?<![\w./-])gradzip(?:\.[A-Za-z_]\w*)+")
REPO_PATH = re.compile(r"(?<![\w./-])(?:gradzip|tests|docs|\.ci)/[^\s`'\"()\[\]|,;:#]*")


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            if importlib.util.find_spec(".".join(parts[:k])) is not None:
                break
        except ModuleNotFoundError:
            continue
    else:
        return False
    obj = importlib.import_module(".".join(parts[:k]))
    for p in parts[k:]:
        if not hasattr(obj, p):
            return False
        obj = getattr(obj, p)
    return True


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_named_modules_and_paths_exist(page):
    text = page.read_text(encoding="utf-8")
    names = sorted(set(DOTTED.findall(text)))
    assert not (bad := [n for n in names if not _resolves(n)]), f"{page.name} names what does not exist: {bad}"
    paths = {re.split(r"[*<]", p)[0].rstrip(".") for p in REPO_PATH.findall(text)}
    assert not (bad := sorted(p for p in paths if not (REPO / p).exists())), f"{page.name}: no such files: {bad}"


# ------------------------------------------------------------------------------ the README and the site
def test_readme_is_a_front_page_with_the_ci_test_line():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300, "README.md is the front page: move details into docs/"
    ci = next(line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
              if line.startswith("python3 -m venv"))
    quickstart = ("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && "
                  ".venv/bin/gradzip run quickstart")
    for line in (quickstart, ci):
        assert f"```bash\n{line}\n```" in text, f"README.md must keep, verbatim: {line}"


def test_every_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:", 1)[1]
    listed = set(re.findall(r"(\S+\.md)\s*$", nav, re.M))
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert listed == pages, f"not in the nav: {sorted(pages - listed)}; missing files: {sorted(listed - pages)}"


def test_mkdocs_build_strict(tmp_path):
    missing = [m for m in ("mkdocs", "material") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (pip install -e '.[docs]')")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
                        "--site-dir", str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True,
                       timeout=180, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # The README is not part of the site: its links into docs/ must land on a page and an anchor there.
    for page, anchor in re.findall(r"\]\(docs/([\w/.-]+)\.md(?:#([\w-]+))?\)", README.read_text(encoding="utf-8")):
        html = tmp_path / "site" / ("" if page == "index" else page) / "index.html"
        assert html.is_file(), f"README.md links to docs/{page}.md, which is not a page of the site"
        assert not anchor or f'id="{anchor}"' in html.read_text(encoding="utf-8"), \
            f"README.md links to docs/{page}.md#{anchor}: no such anchor"
