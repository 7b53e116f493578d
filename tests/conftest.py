"""Shared test settings: single-threaded torch (2-core CI machine, multi-process tests), every test
under a timeout (pytest-timeout, see pyproject) so that a hung worker fails a test, not the CI run,
and a gradzip cache that the suite owns.

The suite never reads or writes the user's gradzip cache: at import, before any test runs (so that
every process a test starts, `gradzip train --backend gloo`, sweeps, mpirun, inherits it),
``GRADZIP_CACHE`` points at a temporary directory of this session, removed at its end. Tests that
train use the `corpus` fixture, a small corpus of real English; only
``tests/test_data.py::test_default_corpus`` builds the default corpus, in a cache of its own. The
session fails if its cache holds a default corpus at the end, if a user's cache that did not exist
was created, or if an existing one got an entry for this session's files (other changes there may
come from other gradzip runs, so they do not count)."""

import json
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GRADZIP_NO_PROGRESS", "1")


def user_cache_path() -> Path:
    """Where ``gradzip.data.cache_root()`` puts the cache under the current environment; computed,
    not called, since cache_root creates the directory (tests/test_data.py checks that they agree)."""
    if os.environ.get("GRADZIP_CACHE"):
        return Path(os.environ["GRADZIP_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "gradzip"
    return Path.home() / ".cache" / "gradzip"


def _corpus_entries(cache: Path) -> set[str]:
    d = cache / "corpora"
    return set(os.listdir(d)) if d.is_dir() else set()


# Once per run: a second import of this file (`from conftest import ...` under another import
# mode, or a nested pytest) finds the session in the environment and keeps it.
if not os.environ.get("GRADZIP_TESTS_DIR"):
    os.environ["GRADZIP_TESTS_USER_CACHE"] = str(user_cache_path())  # before the override below
    os.environ["GRADZIP_TESTS_DIR"] = str(Path(tempfile.mkdtemp(prefix="gradzip-tests-")).resolve())
    _OWNER = True
else:
    _OWNER = False
USER_CACHE = Path(os.environ["GRADZIP_TESTS_USER_CACHE"])
_USER_CACHE_EXISTED = USER_CACHE.exists()
_USER_CORPORA = _corpus_entries(USER_CACHE)
SESSION_DIR = Path(os.environ["GRADZIP_TESTS_DIR"])
SESSION_CACHE = SESSION_DIR / "cache"
os.environ["GRADZIP_CACHE"] = str(SESSION_CACHE)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def corpus() -> Path:
    """A small corpus of real English, one file for the whole session (so tests with the same
    settings share one cached tokenizer and example set): the stdlib's pydoc topics, one document
    per paragraph, ~0.4 MB. No download, and a tokenizer trains on it in seconds."""
    from pydoc_data.topics import topics

    path = SESSION_DIR / "corpus" / "pydoc-topics.txt"
    path.parent.mkdir(exist_ok=True)
    path.write_text("\n\n".join(t.strip() for _, t in sorted(topics.items())) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def session_cache() -> Path:
    """The session's gradzip cache (``$GRADZIP_CACHE`` during the suite)."""
    return SESSION_CACHE


@pytest.fixture(scope="session")
def user_cache() -> Path:
    """The user's gradzip cache, as the environment named it before the suite overrode it."""
    return USER_CACHE


# `pytest -m quick`: the subset to run while iterating (about half a minute on 2 cores): the compressor
# contract, the configuration and its bad input, the sync-mode registry, and one distributed smoke
# test per backend (sim, gloo, mpi). The full suite stays the CI's (`.ci/run`).
QUICK = (
    "tests/test_core.py::", "tests/test_compressors.py::", "tests/test_bad_input.py::", "tests/test_comm_sim.py::",
    "tests/test_train.py::test_config_from_dict_is_strict", "tests/test_train.py::test_toml_round_trip",
    "tests/test_train.py::test_bad_config_file_is_one_line_error", "tests/test_models.py::test_bad_config",
    "tests/test_sync_modes.py::test_every_registered_mode_serves_the_protocol_on_sim",
    "tests/test_sync_modes.py::test_make_synchronizer_is_a_lookup",
    "tests/test_comm_backends.py::test_gloo_2_ranks_and_peer_death",
    "tests/test_comm_backends.py::test_mpi_2_ranks_and_peer_death",
)


def pytest_collection_modifyitems(config, items):
    """Every test that starts processes or opens sockets (marked `distributed` or `root`) keeps a
    timeout of its own, so a hang fails within minutes with the rank's name, not at the default.
    The tests of :data:`QUICK` get the `quick` marker."""
    for item in items:
        if item.nodeid.startswith(QUICK):
            item.add_marker(pytest.mark.quick)
    def starts_processes(item: pytest.Item) -> bool:
        return bool(item.get_closest_marker("distributed") or item.get_closest_marker("root"))

    bare = [i.nodeid for i in items if starts_processes(i) and not i.get_closest_marker("timeout")]
    if bare:
        raise pytest.UsageError("tests marked distributed/root need @pytest.mark.timeout(...): " + ", ".join(bare))


def cache_problems() -> list[str]:
    """What the session did to caches it must not touch (see the module docstring)."""
    problems = [f"a test built the default corpus in the session cache ({p}); give it a corpus (the `corpus` "
                f"fixture); only test_data.py::test_default_corpus builds the default corpus, in its own cache"
                for p in sorted((SESSION_CACHE / "corpora").glob("default-*"))]
    if USER_CACHE.is_relative_to(SESSION_DIR):
        return problems
    if not _USER_CACHE_EXISTED and USER_CACHE.exists():
        problems.append(f"the user's gradzip cache {USER_CACHE} was created during the tests (by a test that "
                        f"dropped GRADZIP_CACHE from a child's environment, or by another gradzip run)")
    # An existing user cache may be in use by other runs meanwhile: only entries of this session's files count.
    for name in sorted(_corpus_entries(USER_CACHE) - _USER_CORPORA):
        try:
            source = json.loads((USER_CACHE / "corpora" / name / "meta.json").read_text())["source"]
        except (OSError, ValueError, KeyError):
            continue
        if Path(source).is_relative_to(SESSION_DIR):
            problems.append(f"the user's gradzip cache got {USER_CACHE / 'corpora' / name} (corpus {source}) "
                            f"from this session")
    return problems


_problems: list[str] = []


def pytest_sessionfinish(session, exitstatus):
    _problems[:] = cache_problems()
    if _problems and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    for p in _problems:
        terminalreporter.write_line(f"CACHE ERROR: {p}", red=True, bold=True)


def pytest_unconfigure(config):
    if _OWNER:
        shutil.rmtree(SESSION_DIR, ignore_errors=True)


def mpi_unavailable() -> str | None:
    """Why the MPI tests cannot run here (no mpirun, or no mpi4py), or None if they can."""
    try:
        from gradzip.comm.launch import find_mpirun

        find_mpirun()
        import mpi4py  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any reason is a skip reason
        return f"mpirun/mpi4py unavailable: {e}"
    return None
