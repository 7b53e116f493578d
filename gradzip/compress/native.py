"""Fused CPU kernels in C, compiled on first use (``_kernels.c``), with the numpy/torch path as fallback.

Why: error feedback and aggregation are memory-bound chains of element-wise passes. numpy and torch
run each pass at memory speed but cannot fuse them, and ``torch.compile`` on the CPU was measured
slower than the eager path on these chains (BENCHMARKS.md). One C loop does in one pass what took
two to four:

- :func:`sign_pack_sub`: pack the sign bits and subtract ``copysign(scale, x)`` (1-bit EF);
- :func:`sum_signs`: the mean of n ranks' ``±scale`` codes, without a decode per rank;
- :func:`sub_finite`: error feedback's residual against a decoded payload, non-finite entries zeroed;
- :func:`at_least`: top-k's candidate filter (the indices whose magnitude reaches a threshold);
- :func:`unpack_votes` and :func:`majority_decode`: ``signsgd``'s majority vote, counted and decoded
  straight from the packed bits.

Every kernel gives the same floats as the path it replaces (tests/test_native.py checks it bit for
bit), so results never depend on whether the kernels are in use.

Kernels of other packages use the same builder and switch: :func:`build` compiles a C source beside
its Python binding (DiLoCo's outer step: ``gradzip/engine/_outer_sgd.c``, bound in
:mod:`gradzip.engine.outer_step`), :func:`ranges` and :func:`run_ranges` split a kernel's work over
the intra-op threads, and such a kernel is used only where :func:`lib` is (``GRADZIP_NATIVE=0``
turns every kernel off).

Build: ``$CC`` (default ``cc``) ``-O3 -march=native -shared -fPIC``, once per source and CPU, into
the gradzip cache (``$GRADZIP_CACHE``, else ``$XDG_CACHE_HOME/gradzip``, else ``~/.cache/gradzip``)
under ``native/``. The library is written to a temporary file and renamed, so ranks that start at
once never load a half-written file. With no compiler, a failed build or ``GRADZIP_NATIVE=0``,
:func:`lib` is None and the callers keep their numpy/torch path; :func:`status` says which and why
(``gradzip bench compress`` prints it).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

_SOURCE = Path(__file__).with_name("_kernels.c")
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-fno-strict-aliasing", "-ffp-contract=off"]
_lib: ctypes.CDLL | None = None
_why = "not loaded yet"
_tried = False
_lock = threading.Lock()


def _cache_dir() -> Path:
    if os.environ.get("GRADZIP_CACHE"):
        return Path(os.environ["GRADZIP_CACHE"]) / "native"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "gradzip" / "native"
    return Path.home() / ".cache" / "gradzip" / "native"


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and feature flags (Linux), else the machine."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        return "\n".join(sorted({ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.machine() + platform.processor()


def build(source: Path) -> ctypes.CDLL:
    """Compile the C file ``source`` (once per source text, compiler, flags and CPU, into the cache as
    ``STEM-TAG.so``, the stem without its leading ``_``) and load it; the caller declares the
    functions' ctypes signatures. Raises RuntimeError, OSError or SubprocessError when it cannot."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not on PATH)")
    src, stem = source.read_bytes(), source.stem.lstrip("_")
    tag = hashlib.sha256(src + " ".join([cc, *_FLAGS]).encode() + _cpu_id().encode()).hexdigest()[:16]
    out = _cache_dir() / f"{stem}-{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{stem}-", suffix=".so")
        os.close(fd)
        try:
            res = subprocess.run([cc, *_FLAGS, "-o", tmp, str(source)], capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                last = (res.stderr.strip().splitlines() or [f"exit code {res.returncode}"])[-1]
                raise RuntimeError(f"{cc} failed: {last}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(out))


def _build() -> ctypes.CDLL:
    lib = build(_SOURCE)
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.gz_sign_pack_sub.argtypes = [ptr, i64, f32, ptr, ctypes.c_int]
    lib.gz_sign_pack_sub.restype = None
    lib.gz_sum_signs.argtypes = [ptr, ptr, i64, i64, f32, ptr]
    lib.gz_sum_signs.restype = ctypes.c_int
    lib.gz_unpack_votes.argtypes = [ptr, ptr, i64, f32, ptr]
    lib.gz_unpack_votes.restype = None
    lib.gz_majority_decode.argtypes = [ptr, i64, i64, f32, ptr]
    lib.gz_majority_decode.restype = ctypes.c_int
    lib.gz_at_least.argtypes = [ptr, i64, ctypes.c_int32, ptr]
    lib.gz_at_least.restype = i64
    lib.gz_sub_finite.argtypes = [ptr, ptr, i64]
    lib.gz_sub_finite.restype = None
    return lib


def lib() -> ctypes.CDLL | None:
    """The loaded kernels, built on the first call; None when disabled or unavailable (see :func:`status`)."""
    global _lib, _why, _tried
    if _tried:
        return _lib
    with _lock:  # sim's threaded workers may ask at once: one build
        if _tried:
            return _lib
        if os.environ.get("GRADZIP_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
            _why = "disabled by GRADZIP_NATIVE=0"
        else:
            try:
                _lib, _why = _build(), "in use"
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _why = f"unavailable ({e}); using the numpy/torch path"
        _tried = True
    return _lib


def status() -> str:
    """One line: whether the fused kernels are in use, and if not, why."""
    lib()
    return f"native kernels: {_why}"


def reset() -> None:
    """Forget the loaded library, so the next :func:`lib` call looks again (tests: GRADZIP_NATIVE)."""
    global _lib, _why, _tried
    _lib, _why, _tried = None, "not loaded yet", False


def usable(t: Tensor, dtype: torch.dtype) -> bool:
    """The kernels are loaded and take ``t``: a contiguous CPU tensor of ``dtype``."""
    return t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() and lib() is not None


def ranges(n: int, align: int) -> list[tuple[int, int]]:
    """[start, end) ranges, one per intra-op thread (``torch.get_num_threads()``), cut at multiples of
    ``align``; one range for small ``n``, where starting threads would cost more than they save."""
    threads = torch.get_num_threads()
    if threads <= 1 or n < PARALLEL_MIN:
        return [(0, n)]
    step = -(-n // threads // align) * align
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def run_ranges(parts: list[tuple[int, int]], fn: Callable[[int, int], Any]) -> list[Any]:
    """``fn`` on every range, on the pool's threads (ctypes releases the GIL during each call)."""
    global _pool
    if len(parts) == 1:
        return [fn(*parts[0])]
    if _pool is None or _pool._max_workers < len(parts):
        _pool = ThreadPoolExecutor(len(parts), thread_name_prefix="gradzip-native")
    return list(_pool.map(lambda ab: fn(*ab), parts))


PARALLEL_MIN = 1 << 20  # elements below which the kernels run on the calling thread only
_pool: ThreadPoolExecutor | None = None


def _forget_pool() -> None:  # a forked child has none of the parent's threads: start a new pool
    global _pool
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def sign_pack_sub(x: Tensor, scale: float | None) -> Tensor | None:
    """Packed sign bits of the flat fp32 CPU tensor ``x``; with a ``scale``, also ``x -= copysign(scale, x)``
    in the same pass (mutates ``x`` into error feedback's residual). None when the kernels are unavailable."""
    k = lib()
    if k is None or not usable(x, torch.float32):
        return None
    n = x.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8)
    xp, op, sc, sub = x.data_ptr(), out.data_ptr(), 0.0 if scale is None else scale, int(scale is not None)
    run_ranges(ranges(n, 64), lambda a, b: k.gz_sign_pack_sub(xp + 4 * a, b - a, sc, op + a // 8, sub))
    return out


def _f32(x: Tensor | float) -> float:
    return float(torch.as_tensor(x, dtype=torch.float32))


def _out(nbytes: int) -> Tensor:
    # numpy's allocation, as bitpack.empty: huge pages make the fresh buffer's faults cheaper
    return torch.from_numpy(np.empty(8 * nbytes, dtype=np.float32))


def sum_signs(packeds: list[Tensor], scales: list[Tensor | float], divisor: float) -> Tensor | None:
    """``Σ_r ±scales[r] / divisor`` over the ranks' packed sign codes, in rank order, as a new fp32
    tensor of 8 elements per byte; None when the kernels are unavailable."""
    k = lib()
    if k is None or not all(usable(p, torch.uint8) for p in packeds):
        return None
    out = _out(packeds[0].numel())
    ptrs = [p.data_ptr() for p in packeds]
    vals = (ctypes.c_float * len(scales))(*[_f32(x) for x in scales])
    op = out.data_ptr()

    def part(a: int, b: int) -> int:  # bytes [a, b)
        return k.gz_sum_signs((ctypes.c_void_p * len(ptrs))(*[q + a for q in ptrs]), vals, len(ptrs), b - a,
                              divisor, op + 32 * a)

    return out if all(run_ranges(_byte_ranges(packeds[0].numel()), part)) else None


def majority_decode(packeds: list[Tensor], scale: Tensor | float) -> Tensor | None:
    """signSGD's vote decoded in one pass, as a new fp32 tensor of 8 elements per byte: ``-scale``
    where more than half the ranks' sign codes are negative, +0 where exactly half are, else
    ``scale``. None when the kernels are unavailable or there are 256 ranks or more."""
    k = lib()
    if k is None or not all(usable(p, torch.uint8) for p in packeds):
        return None
    out = _out(packeds[0].numel())
    ptrs, op, sc = [p.data_ptr() for p in packeds], out.data_ptr(), _f32(scale)

    def part(a: int, b: int) -> int:
        return k.gz_majority_decode((ctypes.c_void_p * len(ptrs))(*[q + a for q in ptrs]), len(ptrs), b - a,
                                    sc, op + 32 * a)

    return out if all(run_ranges(_byte_ranges(packeds[0].numel()), part)) else None


def _byte_ranges(nbytes: int) -> list[tuple[int, int]]:
    """:func:`ranges` of packed bytes, each standing for 8 elements."""
    return [(a // 8, min(b // 8, nbytes)) for a, b in ranges(8 * nbytes, 64)]


def unpack_votes(negative: Tensor, tie: Tensor | None, scale: Tensor | float) -> Tensor | None:
    """A new fp32 tensor of 8 elements per byte: +0 where ``tie``, else ``-scale`` where ``negative``,
    else ``scale`` (packed bits; ``tie`` None: no ties). None when the kernels are unavailable."""
    k = lib()
    if k is None or not usable(negative, torch.uint8) or (tie is not None and not usable(tie, torch.uint8)):
        return None
    out = _out(negative.numel())
    np_, tp, op, sc = negative.data_ptr(), None if tie is None else tie.data_ptr(), out.data_ptr(), _f32(scale)
    run_ranges(_byte_ranges(negative.numel()),
         lambda a, b: k.gz_unpack_votes(np_ + a, None if tp is None else tp + a, b - a, sc, op + 32 * a))
    return out



def sub_finite(m: Tensor, t: Tensor) -> bool:
    """``m -= t``, then +0 wherever the difference is inf or NaN, in one pass: the floats of
    ``m.sub_(t).nan_to_num_(0.0, 0.0, 0.0)``. Mutates ``m``. False (nothing done) when the kernels
    are unavailable or ``m``, ``t`` are not contiguous fp32 CPU tensors of one size."""
    k = lib()
    if k is None or m.numel() != t.numel() or not (usable(m, torch.float32) and usable(t, torch.float32)):
        return False
    mp, tp = m.data_ptr(), t.data_ptr()
    run_ranges(ranges(m.numel(), 16), lambda a, b: k.gz_sub_finite(mp + 4 * a, tp + 4 * a, b - a))
    return True


def at_least(keys: Tensor, thr: int) -> Tensor | None:
    """Ascending int32 indices i with ``keys[i] & 0x7fffffff >= thr`` (int32 keys). None when unavailable."""
    k = lib()
    if k is None or not usable(keys, torch.int32):
        return None
    idx = torch.empty(keys.numel(), dtype=torch.int32)  # untouched pages cost nothing: ~1.5 k are written
    kp, ip = keys.data_ptr(), idx.data_ptr()
    parts = ranges(keys.numel(), 64)
    counts = run_ranges(parts, lambda a, b: k.gz_at_least(kp + 4 * a, b - a, int(thr), ip + 4 * a))
    if len(parts) == 1:
        return idx[:counts[0]].clone()
    # each range's indices are relative to its start, and written at its start
    return torch.cat([idx[a:a + c] + a for (a, _), c in zip(parts, counts)])
