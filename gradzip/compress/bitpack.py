"""Low-level kernels for the compressors: bit packing, sign codes and fast buffers.

Bit order is little-endian within a byte: element ``8*i + j`` is bit ``j`` (value ``1 << j``) of
byte ``i``, as ``numpy.packbits(..., bitorder="little")``. n booleans take ``ceil(n / 8)`` bytes;
the padding bits of the last byte are zero.

Why numpy on the CPU: its packbits/unpackbits and comparisons are SIMD kernels that run 3-5x faster
than the equivalent single-thread torch ops, and its large allocations are backed by transparent
huge pages, which makes the page faults of a fresh 64 MiB buffer ~3x cheaper than torch's allocator
(measured with ``gradzip bench compress``). Every CPU result is a zero-copy ``torch.from_numpy``
tensor. Other devices (CUDA) run the equivalent torch ops. No Python loop ever touches elements.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from gradzip.compress import native

# Same-width integer views: the sign bit of a float is the sign of its integer view, and
# ``bits & MAX`` of the view orders like ``abs()`` of the float (NaN above inf).
INT_VIEW: dict[torch.dtype, torch.dtype] = {
    torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
}
_NP_OF: dict[torch.dtype, type] = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16}
_SHIFTS = torch.arange(8, dtype=torch.uint8)
# _SIGN_TABLE[b] = the 8 signs (+1 for bit 0, -1 for bit 1) coded by byte value b.
_SIGN_TABLE = 1.0 - 2.0 * ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).to(torch.float32)


def packed_numel(n: int) -> int:
    """Bytes needed for ``n`` bits."""
    return (n + 7) // 8


def empty(n: int, dtype: torch.dtype, device: torch.device | str = "cpu", zero: bool = False) -> Tensor:
    """A new 1-D tensor of ``n`` elements; on the CPU allocated by numpy (huge pages, see above)."""
    if torch.device(device).type != "cpu":
        return (torch.zeros if zero else torch.empty)(n, dtype=dtype, device=device)
    np_dtype = _NP_OF.get(dtype)
    if np_dtype is None:  # bf16 and integer types numpy lacks: allocate same-width ints and view
        view = INT_VIEW.get(dtype, dtype)
        buf = (np.zeros if zero else np.empty)(n, dtype=torch.empty((), dtype=view).numpy().dtype)
        return torch.from_numpy(buf).view(dtype)
    return torch.from_numpy((np.zeros if zero else np.empty)(n, dtype=np_dtype))


def pack(bits: Tensor) -> Tensor:
    """Pack a bool tensor (any shape, read flat; non-bool: nonzero is 1) into ``uint8``."""
    flat = bits.detach().reshape(-1)
    if flat.dtype != torch.bool:
        flat = flat != 0
    if flat.device.type == "cpu":
        return torch.from_numpy(np.packbits(flat.numpy(), bitorder="little"))
    return _pack_torch(flat)


def _pack_torch(flat: Tensor) -> Tensor:  # any device; used off the CPU
    b = torch.nn.functional.pad(flat.to(torch.uint8), (0, (-flat.numel()) % 8))
    return (b.view(-1, 8) << _SHIFTS.to(b.device)).sum(1, dtype=torch.uint8)


def unpack(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack`: the first ``n`` bits of ``packed`` as a 1-D bool tensor."""
    _check(packed, n)
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=n, bitorder="little").view(np.bool_))
    return _unpack_torch(packed, n)


def _unpack_torch(packed: Tensor, n: int) -> Tensor:  # any device; used off the CPU
    bits = (packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1
    return bits.view(-1)[:n].bool()


def pack_signs(x: Tensor) -> Tensor:
    """Packed sign bits of ``x`` (read flat): bit 1 where the float's sign bit is set (x < 0 or -0.0)."""
    iv = x.detach().reshape(-1).view(INT_VIEW[x.dtype])
    if iv.device.type != "cpu":
        return _pack_torch(iv < 0)
    a = iv.numpy()
    if a.size <= _PACK_CHUNK:
        return torch.from_numpy(np.packbits(a < 0, bitorder="little"))
    # Chunk by chunk, so that the one-byte-per-element mask stays in cache (same bytes: chunks hold
    # whole bytes, and only the last one is padded, as one packbits call pads it).
    out = np.empty(packed_numel(a.size), dtype=np.uint8)
    neg = np.empty(_PACK_CHUNK, dtype=np.bool_)
    for s in range(0, a.size, _PACK_CHUNK):
        part = a[s:s + _PACK_CHUNK]
        np.less(part, 0, out=neg[:part.size])
        out[s // 8:s // 8 + packed_numel(part.size)] = np.packbits(neg[:part.size], bitorder="little")
    return torch.from_numpy(out)


_PACK_CHUNK = 1 << 18  # elements per step of pack_signs (a multiple of 8): a 256 KiB mask


def unpack_signs(packed: Tensor, n: int, scale: Tensor | float, dtype: torch.dtype) -> Tensor:
    """Decode :func:`pack_signs`: a 1-D tensor of ``n`` values ``±scale`` (bit 0: +scale) in ``dtype``.

    Each byte selects a row of a 256 x 8 table of ±scale, so decoding is one gather of 8-value rows;
    in fp32 on the CPU the fused kernel writes the same values straight from the bits.
    """
    _check(packed, n)
    if dtype == torch.float32 and (out := native.sum_signs([packed], [scale], 1.0)) is not None:
        return out[:n]
    table = (_SIGN_TABLE.to(packed.device) * torch.as_tensor(scale, dtype=torch.float32, device=packed.device))
    out = empty(packed.numel() * 8, dtype, packed.device)
    torch.index_select(table.to(dtype), 0, packed.to(torch.int32), out=out.view(-1, 8))
    return out[:n]


def sum_signs(packeds: list[Tensor], n: int, scales: list[Tensor], dtype: torch.dtype,
              chunk_bytes: int = 1 << 13, divisor: int = 1) -> Tensor:
    """``Σ_r unpack_signs(packeds[r], n, scales[r], dtype) / divisor``, summed in rank order, without
    a full-size decode per rank. In fp32 on the CPU one fused kernel reads every rank's byte and
    writes the result once (:mod:`gradzip.compress.native`); otherwise each chunk of
    8·``chunk_bytes`` elements is decoded rank after rank into a cache-resident temporary and
    added. Either way, the same floats as decoding each rank, adding in order and dividing."""
    for p in packeds:
        _check(p, n)
    device = packeds[0].device
    # the kernel: ±scale as the table gives it, the scale's fp32 value with its sign flipped by a 1 bit
    if dtype == torch.float32 and (out := native.sum_signs(packeds, scales, float(divisor))) is not None:
        return out[:n]
    tables = [(_SIGN_TABLE.to(device) * torch.as_tensor(s, dtype=torch.float32, device=device)).to(dtype)
              for s in scales]
    out = empty(packeds[0].numel() * 8, dtype, device)
    rows = out.view(-1, 8)
    tmp = torch.empty(min(chunk_bytes, rows.shape[0]), 8, dtype=dtype, device=device)
    for start in range(0, rows.shape[0], chunk_bytes):
        acc = rows[start:start + chunk_bytes]
        torch.index_select(tables[0], 0, packeds[0][start:start + chunk_bytes].to(torch.int32), out=acc)
        t = tmp[:acc.shape[0]]
        for table, p in zip(tables[1:], packeds[1:]):
            torch.index_select(table, 0, p[start:start + chunk_bytes].to(torch.int32), out=t)
            acc += t
    return out[:n] if divisor == 1 else out[:n].div_(divisor)


def majority_signs(packeds: list[Tensor]) -> tuple[Tensor, Tensor | None]:
    """Majority vote of packed sign codes (bit 1 = negative), computed on the packed bytes: a
    bit-sliced counter adds the ranks' bits 8 positions per byte op, so no sign is ever unpacked.
    Returns ``(negative, tie)``, packed: ``negative`` where more than half the ranks voted
    negative, ``tie`` where exactly half did (None for an odd number of ranks)."""
    planes: list[Tensor] = []  # bit k of every position's count of negative votes
    for i, p in enumerate(packeds, 1):
        carry = p.clone()
        for k in range(len(planes)):
            nxt = planes[k] & carry
            planes[k] ^= carry
            carry = nxt
        if len(planes) < i.bit_length():  # i votes need i.bit_length() bits; no host sync to find out
            planes.append(carry)
    half = len(packeds) // 2
    gt = torch.zeros_like(packeds[0])
    eq = torch.full_like(packeds[0], 255)
    for k in reversed(range(max(len(planes), half.bit_length()))):  # compare the count with half, MSB first
        plane = planes[k] if k < len(planes) else torch.zeros_like(gt)
        if (half >> k) & 1:
            eq &= plane
        else:
            gt |= eq & plane
            eq &= ~plane
    return gt, (eq if len(packeds) % 2 == 0 else None)


def unpack_votes(negative: Tensor, tie: Tensor | None, n: int, scale: Tensor | float, dtype: torch.dtype) -> Tensor:
    """Decode a vote (:func:`majority_signs`): ``-scale`` where ``negative``, 0 where ``tie``, else
    ``+scale``, in one gather: each (tie byte, negative byte) pair selects a row of a 65536 x 8
    table (2 MiB in fp32, cache-resident)."""
    if tie is None:
        return unpack_signs(negative, n, scale, dtype)
    _check(negative, n)
    if dtype == torch.float32 and (out := native.unpack_votes(negative, tie, scale)) is not None:
        return out[:n]
    device = negative.device
    bits = ((torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1).bool()
    signs = (1.0 - 2.0 * bits.float()) * torch.as_tensor(scale, dtype=torch.float32, device=device)  # by negative byte
    table = torch.where(bits.unsqueeze(1), 0.0, signs.unsqueeze(0)).reshape(65536, 8).to(dtype)  # [tie, negative]
    out = empty(negative.numel() * 8, dtype, device)
    idx = negative.to(torch.int32) | (tie.to(torch.int32) << 8)
    torch.index_select(table, 0, idx, out=out.view(-1, 8))
    return out[:n]


def decode_vote(packeds: list[Tensor], n: int, scale: Tensor | float, dtype: torch.dtype) -> Tensor:
    """``unpack_votes(*majority_signs(packeds), n, scale, dtype)``: in fp32 on the CPU counted and
    decoded in one pass by the fused kernel (the same floats)."""
    if dtype == torch.float32 and (out := native.majority_decode(packeds, scale)) is not None:
        return out[:n]
    negative, tie = majority_signs(packeds)
    return unpack_votes(negative, tie, n, scale, dtype)


def mean_abs(x: Tensor) -> Tensor:
    """``mean(|x|)`` as a 0-dim fp32 tensor (0 for an empty tensor), without an |x| temporary on the CPU."""
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    flat = x.detach().reshape(-1)
    if flat.device.type == "cpu" and flat.dtype in (torch.float32, torch.float64) and n < 2**31:
        # BLAS asum: one vectorised read pass, ~10x torch's 1-norm. Imported on first use: scipy.linalg
        # would add ~0.2 s to every gradzip command, most of which never encode a sign.
        from scipy.linalg import blas

        _one_blas_thread()
        asum = blas.sasum if flat.dtype == torch.float32 else blas.dasum
        return torch.tensor(float(asum(flat.numpy())) / n, dtype=torch.float32)
    return torch.linalg.vector_norm(flat, 1, dtype=torch.float32) / n


_blas_limited = False


def _one_blas_thread() -> None:
    """Limit the BLAS libraries that numpy and scipy load (not torch's) to one thread, once.

    scipy's OpenBLAS starts a thread per core. After each call those threads busy-wait, and with
    torch's default 2 threads on 2 cores they took a core from forward and backward: the onebit
    quickstart cell's compute took 2.6x as long. Its multithreaded sum also made ``mean_abs``
    depend on the thread count. One thread gives the same floats as ``OMP_NUM_THREADS=1``.
    """
    global _blas_limited
    if _blas_limited:
        return
    import os

    from threadpoolctl import ThreadpoolController

    torch_dir = os.path.dirname(torch.__file__)
    for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
        if not os.path.realpath(lib.filepath).startswith(os.path.realpath(torch_dir)):
            lib.set_num_threads(1)
    _blas_limited = True


def _check(packed: Tensor, n: int) -> None:
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != packed_numel(n):
        raise ValueError(f"expected {packed_numel(n)} packed uint8 bytes for {n} bits, got "
                         f"{packed.dtype} of shape {tuple(packed.shape)}")
