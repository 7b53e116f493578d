"""Chunked two-dimensional DCT-II (orthonormal) and per-chunk top-k, for ``demo`` and ``distro``. Not a compressor.

A tensor is read as a matrix (R, C): a 0-d tensor as (1, 1), a 1-D tensor of n as (1, n), and a
tensor of shape (d0, d1, ...) as (d0, d1·...). Each axis is cut into chunks of ``chunk``; when
``chunk`` does not divide it, the last chunk of that axis is the remainder (an axis shorter than
``chunk`` is one chunk). So chunks tile the matrix exactly, with no padding, in at most four
*regions* of equal-sized chunks (full × full, full × rest, rest × full, rest × rest), and 1-D
tensors get 1-D chunks (1 × ``chunk``). A chunk X of a × b is transformed as D_a X D_bᵀ, where D_n
is the orthonormal DCT-II matrix (D_n D_nᵀ = I): the inverse is D_aᵀ Y D_b, and the transform
keeps norms, so a chunk's largest coefficients carry most of its energy.

Coefficients are kept *block-major*: a flat vector of R·C entries holding region after region,
chunk after chunk (row-major), each chunk's a·b coefficients row-major. A coefficient's position
in that vector is its chunk's base plus its index inside the chunk (0 <= index < a·b).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gradzip.compress.base import cast_saturating
from gradzip.compress.quantpack import code_bytes, pack_codes, unpack_codes


@functools.lru_cache(maxsize=64)
def _basis_cpu(n: int) -> Tensor:
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.float()


_BASES: dict[tuple[int, torch.device], Tensor] = {}


def basis(n: int, device: torch.device | str = "cpu") -> Tensor:
    """The orthonormal DCT-II matrix D (n × n, fp32): D[k, i] = s_k cos(π (2i + 1) k / 2n),
    s_0 = √(1/n), s_k = √(2/n). Computed in fp64, cached per size and device."""
    key = (n, torch.device(device))
    if key not in _BASES:
        _BASES[key] = _basis_cpu(n).to(key[1])
    return _BASES[key]


@dataclass(frozen=True)
class Region:
    """Chunks of a × b covering rows r0..r0+p·a and columns c0..c0+q·b; ``off``: where its
    coefficients start in the block-major vector; ``k``: coefficients kept per chunk."""

    r0: int
    c0: int
    p: int
    q: int
    a: int
    b: int
    k: int
    off: int


@dataclass(frozen=True)
class Plan:
    """How a tensor of some shape is chunked: the matrix (rows, cols), the regions, ``kept`` (the
    coefficients sent: Σ chunks · k) and ``bits`` (per index: enough for the largest chunk)."""

    rows: int
    cols: int
    regions: tuple[Region, ...]
    kept: int
    bits: int


def _segments(n: int, chunk: int) -> list[tuple[int, int, int]]:
    """(start, number of chunks, chunk size) along an axis of n."""
    full, rest = divmod(n, chunk)
    return [s for s in ((0, full, chunk), (full * chunk, 1, rest)) if s[1] and s[2]]


@functools.lru_cache(maxsize=4096)
def plan(shape: tuple[int, ...], chunk: int, topk: int) -> Plan:
    """The chunking of a tensor of ``shape`` (see the module docstring)."""
    numel = math.prod(shape)
    rows = 0 if numel == 0 else (1 if len(shape) < 2 else shape[0])
    cols = 0 if numel == 0 else numel // max(rows, 1)
    regions, off, kept = [], 0, 0
    for r0, p, a in _segments(rows, chunk):
        for c0, q, b in _segments(cols, chunk):
            k = min(topk, a * b)
            regions.append(Region(r0, c0, p, q, a, b, k, off))
            off += p * q * a * b
            kept += p * q * k
    biggest = min(chunk, rows) * min(chunk, cols)
    return Plan(rows, cols, tuple(regions), kept, max(1, (biggest - 1).bit_length()))


def largest_divisor(n: int, target: int) -> int:
    """The largest divisor of ``n`` (>= 1) not above ``target`` (>= 1): ``n`` itself when ``n <= target``."""
    return next(d for d in range(min(n, target), 0, -1) if n % d == 0)


@functools.lru_cache(maxsize=4096)
def divisor_plan(shape: tuple[int, ...], chunk: int, topk: int) -> Plan:
    """The chunking of Psyche's DisTrO: the matrix (R, C) read as in :func:`plan`, cut into chunks
    of a × b, a and b the largest divisors of R and C not above ``chunk`` (so one region, no
    remainder: a prime C > ``chunk`` gives columns of width 1); indices in whole bytes, 8 bits
    for chunks of at most 256 elements, else 16 (``chunk`` <= 256)."""
    numel = math.prod(shape)
    if not numel:
        return Plan(0, 0, (), 0, 8)
    rows = 1 if len(shape) < 2 else shape[0]
    cols = numel // rows
    a, b = largest_divisor(rows, chunk), largest_divisor(cols, chunk)
    p, q, k = rows // a, cols // b, min(topk, a * b)
    return Plan(rows, cols, (Region(0, 0, p, q, a, b, k, 0),), p * q * k, 8 if a * b <= 256 else 16)


def _region(x: Tensor, g: Region) -> Tensor:
    """Region ``g`` of the matrix ``x`` as (p, a, q·b): p row strips of a rows (a view)."""
    return x[g.r0:g.r0 + g.p * g.a, g.c0:g.c0 + g.q * g.b].view(g.p, g.a, g.q * g.b)


def forward(x: Tensor, pl: Plan) -> Tensor:
    """Block-major DCT coefficients (fp32, R·C) of the fp32 matrix ``x`` (R, C). Per region, two
    plain matmuls (D_a from the left on each row strip, then D_bᵀ from the right on every row of
    b), then one copy into block-major order."""
    out = torch.empty(pl.rows * pl.cols, dtype=torch.float32, device=x.device)
    for g in pl.regions:
        da, db = basis(g.a, x.device), basis(g.b, x.device)
        y = torch.matmul(torch.matmul(da, _region(x, g)).view(-1, g.b), db.T)  # (p·a·q, b)
        out[g.off:g.off + y.numel()].view(g.p, g.q, g.a, g.b).copy_(y.view(g.p, g.a, g.q, g.b).transpose(1, 2))
    return out


def inverse(coeffs: Tensor, pl: Plan) -> Tensor:
    """The fp32 matrix (R, C) whose block-major coefficients are ``coeffs`` (fp32)."""
    out = torch.empty(pl.rows, pl.cols, dtype=torch.float32, device=coeffs.device)
    for g in pl.regions:
        da, db = basis(g.a, coeffs.device), basis(g.b, coeffs.device)
        y = coeffs[g.off:g.off + g.p * g.q * g.a * g.b].view(g.p, g.q, g.a, g.b).transpose(1, 2).reshape(-1, g.b)
        _region(out, g).copy_(torch.matmul(da.T, torch.matmul(y, db).view(g.p, g.a, g.q * g.b)))
    return out


def top_per_chunk(coeffs: Tensor, pl: Plan) -> tuple[Tensor, Tensor]:
    """The k coefficients of largest magnitude of every chunk: (indices inside their chunk, int64;
    positions in the block-major vector, int64), ``pl.kept`` of each, chunk after chunk."""
    local, where = [], []
    for g in pl.regions:
        n = g.a * g.b
        y = coeffs[g.off:g.off + g.p * g.q * n].view(g.p * g.q, n)
        idx = y.abs().topk(g.k, dim=1, sorted=False).indices
        local.append(idx.reshape(-1))
        where.append((idx + g.off + n * torch.arange(g.p * g.q, device=idx.device).unsqueeze(1)).reshape(-1))
    if not local:
        empty = torch.empty(0, dtype=torch.int64, device=coeffs.device)
        return empty, empty
    return torch.cat(local), torch.cat(where)


def positions(local: Tensor, pl: Plan) -> Tensor:
    """Block-major positions of the indices-inside-chunk ``local`` (laid out as :func:`top_per_chunk` gives them)."""
    bases = [g.off + g.a * g.b * torch.arange(g.p * g.q, device=local.device).repeat_interleave(g.k)
             for g in pl.regions]
    return local + torch.cat(bases) if bases else local


def nbytes(pl: Plan, itemsize: int) -> int:
    """Payload bytes of one tensor: ceil(kept · bits / 8) for the indices + kept · itemsize."""
    return code_bytes(pl.kept, pl.bits) + pl.kept * itemsize


def send_top(delta: Tensor, pl: Plan, wire: torch.dtype) -> tuple[Tensor, Tensor]:
    """The top-k coefficients of every chunk of the fp32 matrix ``delta``: (indices inside their
    chunks packed in ``pl.bits`` bits each, uint8; values cast to ``wire``, fp16 saturating).
    Subtracts from ``delta``, in place, the inverse DCT of the values as sent (as rounded)."""
    coeffs = forward(delta, pl)
    local, where = top_per_chunk(coeffs, pl)
    sent = cast_saturating(coeffs[where], wire)
    if not pl.kept:
        return torch.empty(0, dtype=torch.uint8, device=delta.device), sent
    delta.sub_(inverse(torch.zeros_like(coeffs).index_put_((where,), sent.float()), pl))
    return pack_codes(local, pl.bits), sent


def add_payload(packed: Tensor, values: Tensor, plans: list[Plan], outs: list[Tensor]) -> None:
    """``outs[i][position] += value`` for one rank's payload of tensors chunked as ``plans`` (their
    :func:`send_top` outputs concatenated); ``outs[i]``: tensor i's block-major coefficients,
    fp32. A rank's positions are distinct, so any order of the additions gives the same sums."""
    byte = val = 0
    for pl, out in zip(plans, outs):
        nb = code_bytes(pl.kept, pl.bits)
        if pl.kept:
            local = unpack_codes(packed[byte:byte + nb], pl.kept, pl.bits).to(device=out.device, dtype=torch.int64)
            out.index_add_(0, positions(local, pl), values[val:val + pl.kept].float())
        byte, val = byte + nb, val + pl.kept
