"""Without its extra, an integration or an example says what to install, in one line, instead of a
``ModuleNotFoundError`` traceback: ``import gradzip.integrations.transformers`` (``.lightning``)
raises :class:`~gradzip.integrations.MissingExtra`, and every script in ``examples/`` prints the
line and exits with code 2. The missing package is simulated (``sys.modules[name] = None``, or a
finder that refuses it), so these run with the extras installed too."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradzip.errors import GradzipError
from gradzip.integrations import MissingExtra, exit_if_missing, install_hint, missing_extra

REPO = Path(__file__).resolve().parents[1]

# Runs an example as `python examples/X.py` would, with some packages made missing first.
RUNNER = """
import importlib.abc, runpy, sys
blocked, how, script = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        return None if name.split(".")[0] not in blocked else self.fail(name)
    def fail(self, name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
for name in blocked:
    if how == "none":
        sys.modules[name] = None
    else:
        sys.modules.pop(name, None)
if how == "finder":
    sys.meta_path.insert(0, Refuse())
sys.argv = [script, "--help"]
sys.path.insert(0, "examples")
runpy.run_path(script, run_name="__main__")
"""


def _run_example(script: str, blocked: str, how: str = "none", **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env}
    if "RANK" not in env:
        environ.pop("RANK", None)
    return subprocess.run([sys.executable, "-c", RUNNER, blocked, how, f"examples/{script}"], cwd=REPO,
                          env=environ, capture_output=True, text=True, timeout=120)


def _one_line(p: subprocess.CompletedProcess, extra: str, package: str) -> None:
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert lines[0].startswith("error: examples/") and f"needs {package}," in lines[0]
    assert f'pip install -e ".[{extra}]"' in lines[0] and f'"gradzip[{extra}]"' in lines[0]
    assert p.stdout == ""


@pytest.mark.parametrize(("script", "blocked", "extra", "package"), [
    ("hf_trainer.py", "transformers", "hf", "transformers"),
    ("accelerate_ddp.py", "accelerate", "hf", "accelerate"),
    ("diloco_hf.py", "transformers", "hf", "transformers"),
    ("lightning_ddp.py", "lightning", "lightning", "lightning"),
    ("lightning_ddp.py", "transformers", "hf", "transformers"),  # toy_mlm's model is a transformers BERT
])
def test_example_without_its_extra_prints_the_install_line(script, blocked, extra, package):
    _one_line(_run_example(script, blocked), extra, package)


def test_example_with_a_refusing_finder_and_on_other_ranks():
    _one_line(_run_example("hf_trainer.py", "transformers", how="finder"), "hf", "transformers")
    quiet = _run_example("hf_trainer.py", "transformers", RANK="1")  # under torchrun: rank 0 says it once
    assert quiet.returncode == 2 and quiet.stderr == ""


@pytest.mark.parametrize(("module", "package", "extra"), [
    ("gradzip.integrations.transformers", "transformers", "hf"),
    ("gradzip.integrations.lightning", "lightning", "lightning"),
])
def test_integration_without_its_extra_raises_one_line(module, package, extra, monkeypatch):
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:  # imported earlier
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, package, None)
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError) as err:
        importlib.import_module(module)
    e = err.value
    assert isinstance(e, MissingExtra) and isinstance(e, GradzipError)
    assert e.__cause__ is None and e.__suppress_context__  # `from None`: no chained traceback
    text = str(e)
    assert "\n" not in text and text.startswith(f"{module} needs {package},")
    assert f'pip install -e ".[{extra}]"' in text


def test_hint_names_the_extra_of_a_missing_dependency():
    dep = ModuleNotFoundError("No module named 'safetensors'", name="safetensors")
    assert 'needs safetensors, which is not installed: pip install -e ".[hf]"' in install_hint("x", dep, "hf")
    acc = ModuleNotFoundError("No module named 'accelerate.utils'", name="accelerate.utils")
    hint = install_hint("x", acc, "lightning")
    assert "needs accelerate," in hint and '".[hf]"' in hint


def test_a_missing_gradzip_module_is_not_an_extra(capsys):
    broken = ModuleNotFoundError("No module named 'gradzip.nothing'", name="gradzip.nothing")
    with pytest.raises(ModuleNotFoundError):
        missing_extra("x", broken, "hf")
    with pytest.raises(ModuleNotFoundError), exit_if_missing("x", "hf"):
        raise broken
    with pytest.raises(SystemExit) as stop, exit_if_missing("examples/x.py", "hf"):
        raise MissingExtra("gradzip.integrations.lightning needs lightning, ...")
    assert stop.value.code == 2
    assert capsys.readouterr().err == "error: gradzip.integrations.lightning needs lightning, ...\n"
