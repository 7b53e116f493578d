"""DiLoCo's outer step and merge, blocked for the cache: one trip to memory per tensor.

``torch.optim.SGD`` (foreach or not) walks the whole model once per operation: Nesterov momentum
is four element-wise passes (``buf *= μ``, ``buf += Δ``, ``Δ += μ·buf``, ``θ −= lr·Δ``), and
DiLoCo's merge into the local parameters is one more. Each pass streams every tensor it touches
through main memory. :func:`fused_sgd_step` runs the *same operations in the same order* on
blocks of :data:`CHUNK` elements, so the intermediate results stay in the core's cache: per
element, memory sees one read of Δ, the buffer and θ_global and one write of the buffer,
θ_global and each merge target, the least this update can touch.

The floats are those of ``torch.optim.SGD``: same kernels, same operand order, blocks aligned to
each tensor's start (tested bit for bit against the optimizer). It applies only when the outer
optimizer is a plain ``torch.optim.SGD`` whose ``step`` nobody wrapped or hooked (an LR scheduler
wraps it, a step hook expects to run); :func:`fusable` says so, and otherwise DiLoCo calls
``step()`` as before. The optimizer's state (``momentum_buffer`` per parameter) is read and written
where ``step()`` keeps it, so ``state_dict()``, checkpoints and a later unfused step see no difference.

Where gradzip's C kernels are in use (:mod:`gradzip.compress.native`, built with FMA, torch on its
AVX2 or AVX-512 kernels), each tensor's whole update and merge is one C loop instead
(``gz_outer_sgd`` in ``gradzip/engine/_outer_sgd.c``, built by the same builder as the compressors'
kernels and bound here: :func:`outer_sgd`; the same operations as fused multiply-adds, as torch's
vectorized add-with-alpha computes them; the same floats, tested). Measured (``gradzip bench sync --outer
both``, BENCHMARKS.md): the blocked foreach path was no faster than ``step()`` plus the merge on
a CPU whose L3 holds bert-mini; the C pass is.
"""

from __future__ import annotations

import ctypes
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gradzip.compress import native

CHUNK = 1 << 16  # elements per block: 256 KiB of fp32 per stream, four streams in a core's L2
_SOURCE = Path(__file__).with_name("_outer_sgd.c")
_kernel: list[ctypes.CDLL | None] = []  # [the library, or None where it cannot be built] once tried
_lock = threading.Lock()


def fusable(opt: torch.optim.Optimizer) -> bool:
    """Whether :func:`fused_sgd_step` reproduces ``opt.step()`` exactly."""
    if type(opt) is not torch.optim.SGD or "step" in vars(opt):  # a subclass, or step wrapped (scheduler)
        return False
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return False
    from torch.optim import optimizer as _opt

    if _opt._global_optimizer_pre_hooks or _opt._global_optimizer_post_hooks:
        return False
    # fused=True has its own kernel (already one pass per tensor): its floats are not the foreach ones
    return all(not g.get("maximize", False) and not g.get("differentiable", False) and not g.get("fused")
               and not isinstance(g["lr"], Tensor) for g in opt.param_groups)


@torch.no_grad()
def fused_sgd_step(opt: torch.optim.SGD, items: Sequence[tuple[Tensor, Tensor, Tensor, Sequence[Tensor]]],
                   alpha: float = 0.0) -> None:
    """One SGD step of ``opt`` on θ_global, then the merge, block by block.

    ``items``: per parameter ``(param, theta, grad, targets)``: ``param`` keys the optimizer's
    group and state, ``theta`` (θ_global, contiguous, the parameter's shape) is updated in place,
    ``grad`` (the averaged Δ, contiguous) is consumed (Nesterov overwrites it, as ``step()`` does
    with ``.grad``), and every tensor in ``targets`` (the same number per item) becomes
    ``α·target + (1 − α)·θ_global`` (a copy when α = 0). ``param`` itself is not touched unless it
    is one of the targets.

    Blocks: large tensors are cut into :data:`CHUNK`-element slices and small ones gathered, into
    waves of about :data:`CHUNK` elements; each wave goes through the update with one ``_foreach``
    call per operation (the kernels of ``step()``, a C++ loop instead of one Python call per tensor).
    With the fused C kernel (:func:`outer_sgd_ready`), each tensor takes
    one C pass instead, with the same floats; a merge with α > 0 then follows as ``lerp_``.
    """
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    waves: dict[tuple[int, bool], list[list[Any]]] = {}  # (group, first step) -> waves of slices
    fast = outer_sgd_ready()  # one C pass per tensor instead (_outer_sgd.c)
    scalars = {id(g): sgd_scalars(g) for g in opt.param_groups} if fast else {}
    for param, theta, grad, targets in items:
        g = group_of[id(param)]
        buf = opt.state[param].get("momentum_buffer") if g["momentum"] != 0 else None  # no state without momentum
        first = g["momentum"] != 0 and buf is None
        if first:  # step() starts the buffer as a copy of the (decayed) gradient
            buf = opt.state[param]["momentum_buffer"] = torch.empty_like(grad)
        if fast and outer_sgd(theta, grad, buf, scalars[id(g)], first, list(targets) if alpha == 0 else []):
            for t in targets if alpha != 0 else []:
                t.lerp_(theta, 1.0 - alpha)
            continue
        views = [theta.view(-1), grad.view(-1), buf.view(-1) if buf is not None else None] + \
            [t.view(-1) for t in targets]
        todo = waves.setdefault((id(g), first), [[]])
        for start in range(0, theta.numel(), CHUNK):
            if sum(c[0].numel() for c in todo[-1]) + min(CHUNK, theta.numel() - start) > CHUNK:
                todo.append([])  # this wave is full
            todo[-1].append([v[start:start + CHUNK] if v is not None else None for v in views])
    groups = {id(g): g for g in opt.param_groups}
    for (gid, first), todo in waves.items():
        for wave in todo:
            if wave:
                _update(groups[gid], first, [list(col) for col in zip(*wave)], alpha)


def _update(g: dict[str, Any], first: bool, cols: list[list[Any]], alpha: float) -> None:
    """step()'s operations, in its order, on one wave: ``cols`` = [θ, Δ, buffers, *targets]."""
    th, gr, bufs, *outs = cols
    lr, mom, damp, wd = float(g["lr"]), float(g["momentum"]), float(g["dampening"]), float(g["weight_decay"])
    if wd != 0:
        torch._foreach_add_(gr, th, alpha=wd)
    if mom != 0:
        if first:
            torch._foreach_copy_(bufs, gr)
        else:
            torch._foreach_mul_(bufs, mom)
            torch._foreach_add_(bufs, gr, alpha=1 - damp)
        if g["nesterov"]:
            torch._foreach_add_(gr, bufs, alpha=mom)
            torch._foreach_add_(th, gr, alpha=-lr)
        else:
            torch._foreach_add_(th, bufs, alpha=-lr)
    else:
        torch._foreach_add_(th, gr, alpha=-lr)
    for o in outs:
        if alpha == 0:
            torch._foreach_copy_(o, th)
        else:
            torch._foreach_lerp_(o, th, 1.0 - alpha)


# ------------------------------------------------------------------------------ the C kernel
def _lib() -> ctypes.CDLL | None:
    """The outer-step kernel, built on first use; None where gradzip's kernels are off or unavailable
    (:func:`gradzip.compress.native.lib`, the one switch for every kernel) or this one fails to build."""
    if native.lib() is None:
        return None
    with _lock:  # sim's threaded workers may ask at once: one build
        if not _kernel:
            try:
                lib = native.build(_SOURCE)
            except (OSError, RuntimeError, subprocess.SubprocessError):
                lib = None
            if lib is not None:
                i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
                lib.gz_outer_sgd.argtypes = [ptr, ptr, ptr, i64, f32, f32, f32, f32, ctypes.c_int, ctypes.c_int,
                                             ptr, i64]
                lib.gz_outer_sgd.restype = ctypes.c_int
                lib.gz_has_fma.argtypes = []
                lib.gz_has_fma.restype = ctypes.c_int
            _kernel.append(lib)
    return _kernel[0]


def outer_sgd_ready() -> bool:
    """Whether :func:`outer_sgd` can run: the kernel is loaded, built with FMA, and torch's CPU
    kernels (whose floats it reproduces) are its AVX2 or AVX-512 ones."""
    k = _lib()
    return k is not None and bool(k.gz_has_fma()) and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _f32(x: float) -> float:
    return float(torch.as_tensor(x, dtype=torch.float32))


def sgd_scalars(group: dict[str, Any]) -> tuple[float, float, float, float, int]:
    """An SGD param group's (−lr, momentum, 1 − dampening, weight decay, nesterov), rounded to fp32
    as torch's kernels round them: :func:`outer_sgd`'s settings."""
    return (_f32(-float(group["lr"])), _f32(float(group["momentum"])), _f32(1 - float(group["dampening"])),
            _f32(float(group["weight_decay"])), int(bool(group["nesterov"])))


def outer_sgd(theta: Tensor, grad: Tensor, buf: Tensor | None, scalars: tuple[float, float, float, float, int],
              first: bool, targets: list[Tensor]) -> bool:
    """One ``torch.optim.SGD`` step (:func:`sgd_scalars` of its group) on ``theta`` with gradient
    ``grad`` and momentum buffer ``buf`` (None without momentum; started as a copy when ``first``),
    then ``target.copy_(theta)`` for each target, in one pass over memory. Mutates ``theta``, ``buf``
    and the targets, not ``grad``; shapes may differ, sizes may not. The floats of torch's AVX2 and
    AVX-512 kernels, whose add-with-alpha is one fused multiply-add (check :func:`outer_sgd_ready`
    first). False (nothing done) when a tensor is not a contiguous fp32 CPU tensor of that size."""
    k = _lib()
    n = theta.numel()
    tensors = [theta, grad, *targets] + ([buf] if buf is not None else [])
    if k is None or not all(native.usable(t, torch.float32) and t.numel() == n for t in tensors):
        return False
    tp, gp, bp = theta.data_ptr(), grad.data_ptr(), None if buf is None else buf.data_ptr()
    outs = [t.data_ptr() for t in targets]
    neg_lr, mom, keep, wd, nesterov = scalars

    def part(a: int, b: int) -> int:
        ptrs = (ctypes.c_void_p * max(1, len(outs)))(*[q + 4 * a for q in outs])
        return k.gz_outer_sgd(tp + 4 * a, gp + 4 * a, None if bp is None else bp + 4 * a, b - a, neg_lr, mom,
                              keep, wd, nesterov, int(first), ptrs, len(outs))

    return all(native.run_ranges(native.ranges(n, 16), part))
