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
