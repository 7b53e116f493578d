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
from test_plots import write_run

from gradzip.cli import main
from gradzip.plots.results import LossTarget, load_runs
from gradzip.plots.table import results_markdown

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
    (lambda t: t[0] in ("source", ".") and t[1:2] == [".venv/bin/activate"], "activates the virtual environment"),
    (lambda t: Path(t[0]).name in ("pip", "pip3") or _is_python(t, "-m", "pip"), "installs packages"),
    (lambda t: _is_python(t, "-m", "pytest") or Path(t[0]).name == "pytest", "runs the test suite itself"),
    (lambda t: Path(t[0]).name == "ruff", "the linter"),
    (lambda t: Path(t[0]).name == "mkdocs", "builds these pages (test_mkdocs_build_strict does)"),
    (lambda t: t[:3] == ["ip", "netns", "exec"], "needs root: a program on a host of the network testbed"),
    (lambda t: t[0] == "rm", "removes files"),
    (lambda t: t[:2] == ["apt-get", "install"], "installs a Debian package (needs root)"),
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


def test_help_lists_every_bench_subcommand(capsys):
    """The ``bench`` line of ``gradzip --help`` names the benchmarks the ``bench`` parser has, in order."""
    from gradzip.cli import build_parser, main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if re.match(r"^\s+bench\s", line))
    indent = len(lines[at]) - len(lines[at].lstrip())
    text = lines[at].split(None, 1)[1]
    for line in lines[at + 1:]:  # argparse wraps a long help onto deeper-indented lines
        if not line.strip() or len(line) - len(line.lstrip()) <= indent:
            break
        text += " " + line.strip()
    listed = [w.strip() for w in text.split(":", 1)[1].split(",")]

    def subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices

    assert listed == list(subparsers(subparsers(build_parser())["bench"])), \
        f"gradzip --help lists the benchmarks {listed}"


IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def test_readme_shows_one_hero_figure_and_the_gallery_holds_the_rest():
    """The README is a front page: one figure, and a link to the gallery (docs/reproductions.md),
    which shows that figure too; every figure the gallery shows exists."""
    text = README.read_text(encoding="utf-8")
    hero = IMAGE.findall(text)
    assert len(hero) == 1, f"README.md shows {len(hero)} figures: keep one, move the rest to docs/reproductions.md"
    assert "](docs/reproductions.md" in text, "README.md must link to the gallery, docs/reproductions.md"
    gallery = REPO / "docs" / "reproductions.md"
    shown = [(gallery.parent / p).resolve() for p in IMAGE.findall(gallery.read_text(encoding="utf-8"))]
    assert (REPO / hero[0]).resolve() in shown, "docs/reproductions.md must show the README's figure too"
    assert not (missing := [str(p) for p in shown if not p.is_file()]), f"no such figures: {missing}"


def test_compressors_page_lists_every_capability_the_contract_declares():
    """docs/compressors.md's capability table names exactly the class attributes that
    gradzip/compress/base.py declares as capabilities (CAPABILITIES), no more, no fewer."""
    from gradzip.compress.base import CAPABILITIES, Compressor

    text = (REPO / "docs" / "compressors.md").read_text(encoding="utf-8")
    section = text.split("\n### Capabilities\n", 1)[1].split("\n#", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert sorted(listed) == sorted(CAPABILITIES), f"docs/compressors.md lists {listed}; the code: {CAPABILITIES}"
    assert len(listed) == len(set(listed)) and all(hasattr(Compressor, c) for c in listed)


# ---------------------------------------------------------------------- sample outputs
# The sample outputs the README and the manual show are what the commands print.
#
# - **`gradzip simulate`** (cheap, so it runs here, in this process): after each ``bash`` block that
#   holds one ``gradzip simulate`` command,
#
#   * a ``text`` block is its output, verbatim;
#   * a table shows rows and columns of the table it prints: every heading is one of the printed
#     column names and every cell the printed value. A table with fewer rows or columns than printed
#     says so just above it, "N of the M rows" / "N of the M columns" with M the printed count;
#   * the projection table of docs/simulator.md has columns of its own (days at two overlaps): it is
#     checked by ``tests/test_docs.py::test_projection_table_is_what_the_simulator_prints``.
#
# - **Committed results** (a training run is minutes, so it does not run here): a sample preceded by
#   ``<!-- from: PATH -->`` shows the table of PATH, a results file under docs/reproductions/: its
#   table lines, verbatim and in order. The quickstart results there were written by the shipped
#   spec as it is now (the directory keeps the ``spec.toml`` that ``gradzip run`` wrote), and their
#   columns are the ones ``gradzip plot`` writes today.
SAMPLE_PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FROM = re.compile(r"^<!--\s*from:\s*(\S+)\s*-->[ \t]*$", re.M)
CHECKED_ELSEWHERE = ("days (overlap 0)",)  # docs/simulator.md's projection: checked above
NUMBER_WORDS = {w: i for i, w in enumerate(("zero one two three four five six seven eight nine ten eleven "
                                            "twelve thirteen fourteen fifteen").split())}


def _rel(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


# ---------------------------------------------------------------------------- gradzip simulate
def _simulate_samples() -> list[tuple[str, list[str], str, str, str]]:
    """(where, argv, kind, label, sample) for every sample that follows a `gradzip simulate` block."""
    out = []
    for page in SAMPLE_PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            code = re.sub(r"\\\n", " ", m.group(2))
            cmds = [c for c in code.splitlines() if c.strip().startswith("gradzip simulate")]
            if m.group(1) != "bash" or len(cmds) != 1 or "--json" in cmds[0]:
                continue
            after = text[m.end():]
            stop = re.search(r"^(#|```)", after, re.M)
            where = f"{_rel(page)}:{text.count(chr(10), 0, m.start()) + 1}"
            argv = shlex.split(cmds[0].split("#")[0])[1:]
            prose = after[:stop.start()] if stop else after
            if stop and after[stop.start():].startswith("```text"):
                block = FENCE.match(after, stop.start())
                out.append((where, argv, "text", prose, block.group(2) if block else ""))
            elif (table := re.search(r"^\|.*(?:\n\|.*)*", prose, re.M)) and \
                    not any(h in table.group(0).splitlines()[0] for h in CHECKED_ELSEWHERE):
                out.append((where, argv, "table", prose[:table.start()], table.group(0)))
    return out


SIMULATE = _simulate_samples()


def _printed(argv: list[str], capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def _printed_table(out: str) -> tuple[list[str], list[list[str]]]:
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.split()[:1] == ["compressor"])
    header = lines[start].split()
    rows = []
    for ln in lines[start + 1:]:
        cells = ln.split()
        if len(cells) != len(header):
            break
        rows.append(cells)
    return header, rows


def _cells(line: str) -> list[str]:
    return [c.strip().strip("`") for c in line.strip().strip("|").split("|")]


def _count_said(label: str, what: str) -> tuple[int, int] | None:
    """(N, M) from "N of the M rows" in the label above a table (N in digits or words)."""
    m = re.search(rf"(\w+) of the (\d+) {what}\b", label)
    if not m:
        return None
    n = int(m[1]) if m[1].isdigit() else NUMBER_WORDS.get(m[1].lower(), -1)
    return n, int(m[2])


def test_there_are_simulate_samples():
    kinds = {(w.split(":")[0], k) for w, _, k, _, _ in SIMULATE}
    assert {("README.md", "table"), ("docs/simulator.md", "text")} <= kinds, kinds


@pytest.mark.parametrize(("where", "argv", "kind", "label", "sample"), SIMULATE, ids=[s[0] for s in SIMULATE])
def test_simulate_sample_is_what_it_prints(where, argv, kind, label, sample, capsys):
    out = _printed(argv, capsys)
    if kind == "text":
        got = [ln.rstrip() for ln in out.strip("\n").splitlines()]
        assert [ln.rstrip() for ln in sample.strip("\n").splitlines()] == got, \
            f"{where}: the text block after the command is not what it prints now; paste:\n" + "\n".join(got)
        return
    lines = sample.splitlines()
    head = _cells(lines[0])
    header, rows = _printed_table(out)
    unknown = [h for h in head if h not in header]
    assert not unknown, f"{where}: the table has columns the command does not print: {unknown} (printed: {header}; " \
                        "--json fields belong in the text, not the table)"
    keys = [h for h in ("compressor", "sync") if h in head]
    by_key = {tuple(r[header.index(k)] for k in keys): r for r in rows}
    shown = [_cells(ln) for ln in lines[2:]]
    for cells in shown:
        row = by_key.get(tuple(cells[head.index(k)] for k in keys))
        assert row is not None, f"{where}: the command prints no row {cells[:len(keys)]}"
        want = [row[header.index(h)] for h in head]
        assert cells == want, f"{where}: row {cells[0]} is now | {' | '.join(want)} |"
    for what, n_shown, n_printed in (("rows", len(shown), len(rows)), ("columns", len(head), len(header))):
        if n_shown < n_printed:
            assert _count_said(label, what) == (n_shown, n_printed), \
                f"{where}: the table shows {n_shown} of the {n_printed} {what} printed; say so above it " \
                f"(\"{n_shown} of the {n_printed} {what}\")"


# ---------------------------------------------------------------------------- committed results
def _from_samples() -> list[tuple[str, Path, list[str]]]:
    out = []
    for page in SAMPLE_PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FROM.finditer(text):
            where = f"{_rel(page)}:{text.count(chr(10), 0, m.start()) + 1}"
            after = text[m.end():].lstrip("\n")
            block = FENCE.match(after)
            body = block.group(2) if block else re.match(r"(\|.*\n?)*", after).group(0)
            out.append((where, REPO / m[1], [ln for ln in body.splitlines() if ln.startswith("|")]))
    return out


FROM_SAMPLES = _from_samples()


def test_the_quickstart_sample_names_its_source():
    assert any(w.startswith("docs/experiments.md") and p.parent.name == "quickstart" for w, p, _ in FROM_SAMPLES)


@pytest.mark.parametrize(("where", "path", "table"), FROM_SAMPLES, ids=[s[0] for s in FROM_SAMPLES])
def test_sample_is_the_committed_table(where, path, table):
    assert path.is_file(), f"{where}: <!-- from: {path.relative_to(REPO)} --> names no file"
    committed = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.startswith("|")]
    assert table, f"{where}: no table after the <!-- from: --> marker"
    assert table == committed, f"{where}: the sample is not the table of {path.relative_to(REPO)}; paste:\n" + \
        "\n".join(committed)


def test_quickstart_results_come_from_the_shipped_spec():
    """A changed spec (steps, lr, seed, compressors) changes every number: run it again and commit
    its results.md, results.csv and spec.toml (docs/experiments.md says how)."""
    kept = REPO / "docs" / "reproductions" / "quickstart" / "spec.toml"
    shipped = REPO / "gradzip" / "experiments" / "specs" / "quickstart.toml"
    assert tomllib.loads(kept.read_text(encoding="utf-8")) == tomllib.loads(shipped.read_text(encoding="utf-8")), \
        "gradzip/experiments/specs/quickstart.toml changed since docs/reproductions/quickstart/ was written"


def test_quickstart_results_have_todays_columns(tmp_path):
    """The committed table's header is the one ``gradzip plot`` writes now for runs like the
    quickstart's (accuracies reported, a loss target): synthetic runs, the real table code."""
    spec = tomllib.loads((REPO / "gradzip/experiments/specs/quickstart.toml").read_text(encoding="utf-8"))
    for c in ("none", "fp16", "topk:ratio=0.01,ef=true"):
        d = tmp_path / f"compressor={c.replace(':', '-').replace(',', '-')}"
        write_run(d, c, "1gbit", 4)
        summary = json.loads((d / "summary.json").read_text())
        summary.update(final_eval_mlm_acc=0.06, final_eval_nsp_acc=0.55)
        (d / "summary.json").write_text(json.dumps(summary))
    target = LossTarget(loss=spec["target"]["loss"], metric=spec["target"]["metric"])
    fresh = results_markdown(load_runs(tmp_path), target).splitlines()[:2]
    committed = [ln for ln in (REPO / "docs/reproductions/quickstart/results.md").read_text().splitlines()
                 if ln.startswith("|")][:2]
    assert committed == fresh, "the results table's columns changed: run `gradzip run quickstart` again and " \
                               "commit its results (docs/experiments.md)"
