"""Size and shape rules of the package, beyond the import-linter contracts of ``test_layout.py``:

- no import cycle between two files of ``gradzip``, whatever the level of the import (module top,
  inside a function, inside ``try``): the strongly connected components of grimp's graph of direct
  imports, each reported with one cycle through it and the lines that close it. Imports under
  ``if TYPE_CHECKING:`` are left out: they never run, so they cannot make a cycle at import time;
- no module over 500 lines;
- no function over 80 lines (from its ``def`` to its last line, nested functions included), except
  argparse flag tables: functions whose body is mostly flag definitions (calls that name a
  ``--flag``, ``add_argument_group``, ``add_mutually_exclusive_group``, ``set_defaults``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "gradzip"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
FLAG_TABLE_SHARE = 0.6  # a flag table: at least this share of its body's lines define flags
PARSER_CALLS = {"add_argument", "add_argument_group", "add_mutually_exclusive_group", "set_defaults"}

def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


# ------------------------------------------------------------------------------ import cycles
def _strongly_connected(nodes: list[str], edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit): the components, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in nodes:
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(edges[w])))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    components.append(sorted(comp))
    return components


def _cycle_through(start: str, members: set[str], edges: dict[str, list[str]]) -> list[str]:
    """A shortest cycle from ``start`` back to itself inside one component (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in edges[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w in members and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def _import_graph() -> tuple[list[str], dict[str, list[str]], object]:
    grimp = pytest.importorskip("grimp")  # installed with import-linter (the dev extra)
    graph = grimp.build_graph("gradzip", cache_dir=None, exclude_type_checking_imports=True)
    nodes = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) - {m}) for m in nodes}
    return nodes, edges, graph


def test_no_import_cycle_between_modules():
    nodes, edges, graph = _import_graph()
    found = []
    for comp in _strongly_connected(nodes, edges):
        if len(comp) < 2:
            continue
        cycle = _cycle_through(comp[0], set(comp), edges)
        steps = []
        for a, b in zip(cycle, cycle[1:]):
            lines = sorted({d["line_number"] for d in graph.get_import_details(importer=a, imported=b)})
            steps.append(f"{a} (line {', '.join(map(str, lines))}) -> {b}")
        found.append(f"cycle among {comp}: " + "; ".join(steps))
    assert not found, "import cycles:\n" + "\n".join(found)


# ------------------------------------------------------------------------------ module size
def test_no_module_is_over_500_lines():
    long = {_rel(p): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these modules (over {MAX_MODULE_LINES} lines): {long}"


# ------------------------------------------------------------------------------ function size
def _defines_flags(stmt: ast.stmt) -> bool:
    """A statement of a flag table: a call that names a ``--flag`` (``p.add_argument("--lr", ...)``,
    or a project helper such as ``flag(group, "--lr", ...)``), or one of argparse's grouping calls
    (also assigned: ``g = p.add_argument_group(...)``)."""
    if not isinstance(stmt, (ast.Expr, ast.Assign)) or not isinstance(stmt.value, ast.Call):
        return False
    call = stmt.value
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    if name in PARSER_CALLS:
        return True
    return any(isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")
               and len(a.value) > 1 for a in call.args)


def _is_flag_table(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body_lines = fn.end_lineno - fn.body[0].lineno + 1  # type: ignore[operator]
    flag_lines = set()
    for stmt in fn.body:
        if _defines_flags(stmt):
            flag_lines.update(range(stmt.lineno, stmt.end_lineno + 1))  # type: ignore[operator]
    return len(flag_lines) >= FLAG_TABLE_SHARE * body_lines


def _long_functions() -> dict[str, int]:
    long = {}
    for p in _modules():
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            if n > MAX_FUNCTION_LINES and not _is_flag_table(node):
                long[f"{_rel(p)}:{node.name}"] = n
    return long


def test_no_function_is_over_80_lines():
    long = _long_functions()
    assert not long, f"split these functions (over {MAX_FUNCTION_LINES} lines): {long}"


def test_the_rules_themselves():
    """The helpers on small inputs: a cycle is found and named, a flag table is told from code."""
    comps = _strongly_connected(["a", "b", "c", "d"], {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]})
    assert sorted(comps) == [["a", "b", "c"], ["d"]]
    assert _cycle_through("a", {"a", "b", "c"}, {"a": ["b", "c"], "b": ["c"], "c": ["a"]}) == ["a", "c", "a"]
    table = ast.parse("def f(p):\n    g = p.add_argument_group('x')\n"
                      + "".join(f"    flag(g, '--o{i}', 'help', type=int)\n" for i in range(90))).body[0]
    code = ast.parse("def f(p):\n    x = 1\n" + "".join(f"    x += {i}\n" for i in range(90))).body[0]
    assert _is_flag_table(table) and not _is_flag_table(code)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ names
# The per-trainer integration classes share their name on purpose: it is their contract.
SHARED_NAMES = {"GradzipCallback": {"gradzip/integrations/transformers.py", "gradzip/integrations/lightning.py"}}


def test_no_two_public_classes_share_a_name():
    where: dict[str, set[str]] = {}
    for p in _modules():
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, set()).add(_rel(p))
    shared = {name: files for name, files in where.items() if len(files) > 1 and SHARED_NAMES.get(name) != files}
    assert not shared, f"rename one of each: {shared}"
