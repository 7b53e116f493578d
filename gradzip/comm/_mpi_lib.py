"""The MPI library behind the ``mpi`` backend: loading it through mpi4py (:func:`import_mpi`),
whether it takes CUDA buffers (:func:`cuda_aware_mpi`), and the user-defined sum of fp16/bf16
carried as 16-bit integers (:func:`sum_16bit`)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gradzip.errors import GradzipError


def import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as e:  # mpi4py missing, or no MPI library to load
        raise GradzipError(f"backend mpi needs mpi4py and an MPI library ({e}): pip install 'gradzip[mpi]'") from e
    return MPI


def sum_16bit(dtype: torch.dtype) -> Callable[[Any, Any, Any], None]:
    """MPI user op: ``inout += in`` for fp16/bf16 carried as 16-bit integers."""

    def op(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        a = np.frombuffer(inbuf, dtype=np.int16)
        if a.size == 0:
            return
        b = np.frombuffer(inoutbuf, dtype=np.int16)
        torch.from_numpy(b).view(dtype).add_(torch.from_numpy(a).view(dtype))

    return op


def cuda_aware_mpi() -> bool:
    """Whether the loaded MPI library takes CUDA device buffers."""
    env = os.environ.get("GRADZIP_MPI_CUDA_AWARE")
    if env in ("0", "1"):
        return env == "1"
    import_mpi()
    for path in loaded_libmpi():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "MPIX_Query_cuda_support"):  # Open MPI
            return bool(lib.MPIX_Query_cuda_support())
        if hasattr(lib, "MPIX_GPU_query_support"):  # MPICH: (gpu_type=MPIX_GPU_SUPPORT_CUDA=0, int*)
            flag = ctypes.c_int(0)
            lib.MPIX_GPU_query_support(0, ctypes.byref(flag))
            return bool(flag.value)
    return False


def loaded_libmpi() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libmpi" in line and ".so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(("libmpi.", "libmpi_")))
