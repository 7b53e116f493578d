"""The layering of the package, enforced: the import-linter contracts in ``pyproject.toml``
(``[tool.importlinter]``) must all be kept, so a new import cycle or a lower layer importing a
higher one fails the suite. Also: no private name imported across packages. Sizes and import cycles
between files: ``test_layout_rules.py``."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "gradzip"


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    p = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "BROKEN" not in p.stdout and p.stdout.count("KEPT") >= 4


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_private_name_is_imported_from_another_package():
    """``from gradzip.a.b import _x`` is allowed only inside package ``gradzip.a``."""
    found = []
    for p in _modules():
        own = ".".join(p.relative_to(REPO).with_suffix("").parts[:2])
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradzip."):
                theirs = ".".join(node.module.split(".")[:2])
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private and theirs != own:
                    found.append(f"{p.relative_to(REPO)}: {node.module} {private}")
    assert not found, found


def _own_private_names() -> set[str]:
    """Private attribute names that gradzip's own classes set on ``self`` or declare in a body."""
    names: set[str] = set()
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and ast.unparse(node.value) in (
                    "self", "cls"):
                names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    for t in getattr(stmt, "targets", [getattr(stmt, "target", None)]):
                        if isinstance(t, ast.Name):
                            names.add(t.id)
    return names


def test_no_private_attribute_of_a_torch_object_is_written():
    """Outside ``gradzip/engine/fsdp_compat.py`` (which only reads), no file assigns a private
    attribute that no gradzip class defines, nor ``setattr``s a private name: FSDP's communication
    goes in through its public setters."""
    own, found = _own_private_names(), []
    for p in _modules():
        if p.relative_to(REPO).as_posix() == "gradzip/engine/fsdp_compat.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
                if name.startswith("_") and not name.startswith("__") and name not in own:
                    found.append(f"{p.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and len(node.args) >= 2:
                key = node.args[1]
                if isinstance(key, ast.Constant) and str(key.value).startswith("_") and key.value not in own:
                    found.append(f"{p.relative_to(REPO)}:{node.lineno}: setattr(..., {key.value!r})")
    assert not found, found


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end > 0 else None]


def test_every_subpackage_is_in_the_readme_and_the_layout_page():
    """The README's layout paragraph and docs/layout.md name every sub-package of the code."""
    subpackages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    readme = _section((REPO / "README.md").read_text(), "## Layout")
    layout = (REPO / "docs/layout.md").read_text()
    missing = [f"{where}: {name}/" for name in subpackages for where, text in (("README.md", readme),
               ("docs/layout.md", layout)) if f"{name}/" not in text]
    assert not missing, missing
