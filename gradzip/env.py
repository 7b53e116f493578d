"""``gradzip env``: versions, backends and hardware, for bug reports.

Prints one line per item, the key padded to a column, then the value. Optional pieces (mpi4py,
NCCL, CUDA) are looked up lazily and reported as ``not installed`` / ``not available`` rather than
failing. Fast (about 2 s, mostly importing torch): it touches no network, starts no process group and
does not initialise MPI (the MPI library's version comes from a short child process).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from gradzip import __version__
from gradzip.compress import native
from gradzip.host import busy_elsewhere, choose_threads, usable_cores


def _version(dist: str) -> str:
    """An installed distribution's version, from its metadata (no import: fast)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


_MPI_PROBE = (
    "import mpi4py\n"
    "mpi4py.rc.initialize = mpi4py.rc.finalize = False  # the version query needs no MPI_Init\n"
    "from mpi4py import MPI\n"
    "print(MPI.Get_library_version().strip('\\x00 \\n').splitlines()[0].strip('\\x00 '))\n"  # Open MPI ends in a NUL
)


def _mpi() -> tuple[str, str]:
    """(mpi4py version, the MPI library's first line).

    Importing ``mpi4py.MPI`` normally calls MPI_Init (about a second, and it changes this process),
    so unless it is already imported here, the library is asked in a short child process that skips
    the initialisation.
    """
    ver = _version("mpi4py")
    if ver == "not installed":
        return ver, "not available (mpi4py not installed)"
    if "mpi4py.MPI" in sys.modules:
        try:
            return ver, sys.modules["mpi4py.MPI"].Get_library_version().strip("\x00 \n").splitlines()[0].strip("\x00 ")
        except Exception as e:  # noqa: BLE001
            return ver, f"not available ({type(e).__name__}: {e})"
    try:
        proc = subprocess.run([sys.executable, "-c", _MPI_PROBE], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return ver, f"not available ({type(e).__name__})"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        return ver, f"not available ({last[:200]})"
    return ver, proc.stdout.strip() or "unknown"


def _mpirun() -> str | None:
    here = Path(sys.executable).parent / "mpirun"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("mpirun") or shutil.which("mpiexec")


def _cpu() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return f"{name} ({os.cpu_count()} cores, {usable} usable by this process)"


def collect() -> dict[str, str]:
    """Every line of the report, in order."""
    info: dict[str, str] = {
        "gradzip": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "torch": torch.__version__,
    }
    cuda = torch.cuda.is_available()
    info["cuda"] = f"{torch.version.cuda} ({torch.cuda.device_count()} device(s))" if cuda else "not available"
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else "not available (no CUDA)"
    except Exception:  # noqa: BLE001 - CPU builds have no NCCL
        nccl = "not available"
    info["nccl"] = nccl
    info["mpi4py"], info["mpi library"] = _mpi()
    info["mpirun"] = _mpirun() or "not found"
    info["tokenizers"] = _version("tokenizers")
    info["numpy"] = _version("numpy")
    info["matplotlib"] = _version("matplotlib")

    backends = ["sim"]
    if dist.is_available() and dist.is_gloo_available():
        backends.append("gloo")
    if cuda and dist.is_available() and dist.is_nccl_available():
        backends.append("nccl")
    if info["mpi4py"] != "not installed" and info["mpirun"] != "not found":
        backends.append("mpi")
    info["backends"] = ", ".join(backends)
    info["cpu"] = _cpu()
    threads, why = choose_threads()
    info["torch threads"] = f"{threads} for gradzip train ({why}); torch's default here: {torch.get_num_threads()}"
    info["host load"] = f"{busy_elsewhere():.1f} of {usable_cores()} cores busy with other processes"
    info["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "not set")
    info["native kernels"] = native.status().removeprefix("native kernels: ")
    if cuda:
        info["gpu"] = "; ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    else:
        info["gpu"] = "none"
    return info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    info = collect()
    width = max(len(k) for k in info)
    for k, v in info.items():
        print(f"{k.ljust(width)}  {v}")
    return 0
