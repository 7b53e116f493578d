"""Shared test settings: single-threaded torch (2-core CI machine, multi-process tests), and
every test under a timeout (pytest-timeout, see pyproject) so that a hung worker fails a test,
not the CI run."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GRADZIP_NO_PROGRESS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Every test that starts processes or opens sockets (marked `distributed` or `root`) keeps a
    timeout of its own, so a hang fails within minutes with the rank's name, not at the default."""
    def starts_processes(item: pytest.Item) -> bool:
        return bool(item.get_closest_marker("distributed") or item.get_closest_marker("root"))

    bare = [i.nodeid for i in items if starts_processes(i) and not i.get_closest_marker("timeout")]
    if bare:
        raise pytest.UsageError("tests marked distributed/root need @pytest.mark.timeout(...): " + ", ".join(bare))


def mpi_unavailable() -> str | None:
    """Why the MPI tests cannot run here (no mpirun, or no mpi4py), or None if they can."""
    try:
        from gradzip.comm.launch import find_mpirun

        find_mpirun()
        import mpi4py  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any reason is a skip reason
        return f"mpirun/mpi4py unavailable: {e}"
    return None
