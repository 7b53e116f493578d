"""The parts of chunked top-k (``sparseloco``): the chunk plan (:func:`plan`), the statistical
quantiser (:func:`quantise`) and the index codes. Each chunk (a *row*) of n elements sends the
positions of its k selected entries, in ascending order, in one of two codes:

- **12-bit packing** (:func:`pack12`, :func:`unpack12`): each position in 12 bits, two positions in
  3 bytes (little-endian bit stream, as :func:`gradzip.compress.quantpack.pack_codes`: byte 0 is
  the low 8 bits of the first position, byte 1 its high 4 bits then the low 4 bits of the second,
  byte 2 the second's high 8 bits). ``ceil(12 m / 8)`` bytes for m positions (n <= 4096).
- **Variable-length code** (:func:`rice_encode`, :func:`rice_decode`): per row, whichever is
  smaller of Rice-coded gaps and a bitmap. A row is 1 mode bit (0: Rice, 1: bitmap), then
  for Rice: the parameter p in 4 bits, and for each position, its gap g (the first position
  itself, then the distance to the previous one minus 1) as ``g >> p`` one bits, a zero bit and
  the low p bits of g; for a bitmap: n bits, bit i set when position i is selected. The encoder
  takes the p in 0..12 that makes the row shortest. Bits are little-endian within a byte
  (:mod:`gradzip.compress.bitpack`). A tensor's code is each row's length in bits, 13 bits each
  (:data:`LEN_BITS`; a row never exceeds 5 + 4096 bits), packed, then the rows back to back,
  packed: ``ceil(13 R / 8) + ceil(sum of row lengths / 8)`` bytes for R rows. The lengths let the
  decoder read every row at once (k steps, each over all rows), with no Python loop over elements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gradzip.compress import bitpack
from gradzip.compress.base import numel_of
from gradzip.compress.quantpack import code_bytes, pack_codes, unpack_codes

LEN_BITS = 13  # bits of a row's length: rows of up to 4096 elements take at most 4101 bits
MAX_P = 12  # the largest Rice parameter the encoder tries (4 bits)


def side(n: int, target: int) -> int:
    """The largest divisor of ``n`` not above ``target``."""
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


def plan(shape: Sequence[int] | int, chunk: int) -> tuple[int, int, int, int]:
    """(rows of blocks Y, block height h, blocks per row X, block width w) of a tensor's chunks."""
    dims = [int(shape)] if isinstance(shape, int) else [int(d) for d in shape]
    a, b = (1, numel_of(dims)) if len(dims) < 2 else (dims[0], numel_of(dims[1:]))
    h, w = side(a, chunk), side(b, chunk)
    return a // h, h, b // w, w


def quantise(v: Tensor, bits: int, sigmas: float) -> tuple[Tensor, Tensor]:
    """The codes (uint8) of the fp32 values ``v`` and the table: [shift, bin means]."""
    nb = 1 << bits
    shift = v.mean()
    c = v - shift
    std = c.norm() / math.sqrt(c.numel() - 1) if c.numel() > 1 else torch.zeros((), device=v.device)
    scale = sigmas * std / nb
    scale = torch.where((scale == 0) | ~torch.isfinite(scale), torch.ones_like(scale), scale)
    codes = torch.nan_to_num(c / scale + nb // 2).round().clamp(0, nb - 1).to(torch.uint8)
    sums = torch.zeros(nb, device=v.device).scatter_add_(0, codes.long(), c)
    counts = torch.zeros(nb, device=v.device).scatter_add_(0, codes.long(), torch.ones_like(c))
    return codes, torch.cat([shift.view(1), torch.where(counts > 0, sums / counts, 0.0)])


def pack12(positions: Tensor) -> Tensor:
    """Positions in ``[0, 4096)`` (1-D, any integer dtype) packed 12 bits each: uint8."""
    return pack_codes(positions.to(torch.int32), 12)


def unpack12(packed: Tensor, m: int) -> Tensor:
    """Inverse of :func:`pack12`: the ``m`` positions, int64."""
    return unpack_codes(packed, m, 12).to(torch.int64)


def encode(rows: Tensor, n: int, index: str) -> Tensor:
    """Sorted positions ``rows`` [R, k] of rows of n elements in the code ``index`` (pack12 or rice)."""
    return rice_encode(rows, n) if index == "rice" else pack12(rows.reshape(-1))


def decode(code: Tensor, r: int, n: int, k: int, index: str) -> tuple[Tensor, int]:
    """Inverse of :func:`encode`, read from the start of ``code``: (positions [r, k], bytes read)."""
    if index == "rice":
        return rice_decode(code, r, n, k)
    used = code_bytes(r * k, 12)
    return unpack12(code[:used], r * k).view(r, k), used


def _gaps(rows: Tensor) -> Tensor:
    """Gaps of sorted positions ``rows`` [R, k]: the first position, then each difference minus 1."""
    return torch.cat([rows[:, :1], rows[:, 1:] - rows[:, :-1] - 1], dim=1)


def rice_row_bits(rows: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """For sorted positions ``rows`` [R, k] of rows of n elements: (each row's length in bits, its
    mode (True: bitmap), its Rice parameter), the shortest code per row."""
    g = _gaps(rows)
    p = torch.arange(MAX_P + 1, device=rows.device)
    rice = (g.unsqueeze(2) >> p).sum(1) + rows.shape[1] * (1 + p)  # [R, 13]
    best, par = rice.min(1)
    bitmap = n < best
    return 5 + torch.where(bitmap, torch.full_like(best, n), best), bitmap, par


def rice_bound(rows: int, n: int, k: int) -> int:
    """Upper bound of the code's bytes for ``rows`` rows of n elements with k positions each: per
    row, Rice with any p costs at most k (1 + p) + ((n - k) >> p) bits (the gaps sum to at most
    n - k), and the encoder's choice is no longer than the best of these or the bitmap."""
    body = min([n] + [k * (1 + p) + ((n - k) >> p) for p in range(MAX_P + 1)])
    return code_bytes(rows, LEN_BITS) + code_bytes(rows * (5 + body), 1)


def rice_encode(rows: Tensor, n: int) -> Tensor:
    """The variable-length code of sorted positions ``rows`` [R, k] (int64) of rows of n elements."""
    lengths, bitmap, par = rice_row_bits(rows, n)
    start = torch.cumsum(lengths, 0) - lengths
    bits = torch.zeros(int(lengths.sum()), dtype=torch.bool, device=rows.device)
    bits[start[bitmap]] = True
    four = torch.arange(4, device=rows.device)
    bits[(start + 1).unsqueeze(1) + four] = ((par.unsqueeze(1) >> four) & 1).bool()
    body = start + 5
    if bitmap.any():
        bits[(body[bitmap].unsqueeze(1) + rows[bitmap]).reshape(-1)] = True
    rice = ~bitmap
    if rice.any():
        g, p = _gaps(rows[rice]), par[rice].unsqueeze(1)
        q = g >> p
        size = q + 1 + p
        at = body[rice].unsqueeze(1) + torch.cumsum(size, 1) - size  # each codeword's first bit
        ones = torch.repeat_interleave(at.reshape(-1), q.reshape(-1))
        first = torch.repeat_interleave(torch.cumsum(q.reshape(-1), 0) - q.reshape(-1), q.reshape(-1))
        bits[ones + torch.arange(ones.numel(), device=rows.device) - first] = True
        j = torch.arange(MAX_P, device=rows.device)
        low = ((g.unsqueeze(2) >> j) & 1).bool() & (j < p.unsqueeze(2))
        bits[((at + q + 1).unsqueeze(2) + j)[low]] = True
    return torch.cat([pack_codes(lengths, LEN_BITS), bitpack.pack(bits)])


def rice_decode(code: Tensor, r: int, n: int, k: int) -> tuple[Tensor, int]:
    """Inverse of :func:`rice_encode` for r rows with k positions each, read from the start of
    ``code`` (uint8): (the positions [r, k], int64, ascending per row; the bytes read)."""
    nl = code_bytes(r, LEN_BITS)
    lengths = unpack_codes(code[:nl], r, LEN_BITS).to(torch.int64)
    total = int(lengths.sum())
    bits = torch.cat([bitpack.unpack(code[nl:nl + code_bytes(total, 1)], total),
                      torch.zeros(MAX_P + 1, dtype=torch.bool, device=code.device)])  # reads past the end
    start = torch.cumsum(lengths, 0) - lengths
    four = torch.arange(4, device=code.device)
    bitmap = bits[start]
    par = (bits[(start + 1).unsqueeze(1) + four].long() << four).sum(1)
    out = torch.empty(r, k, dtype=torch.int64, device=code.device)
    if bitmap.any():
        grid = bits[(start[bitmap] + 5).unsqueeze(1) + torch.arange(n, device=code.device)]
        out[bitmap] = grid.nonzero()[:, 1].view(-1, k)
    rice = ~bitmap
    if rice.any():
        zeros = (~bits).nonzero().squeeze(1)
        pos, p, prev = start[rice] + 5, par[rice], torch.full_like(start[rice], -1)
        j = torch.arange(MAX_P, device=code.device)
        for i in range(k):  # one codeword of every row at a time
            stop = zeros[torch.searchsorted(zeros, pos)]
            low = (bits[(stop + 1).unsqueeze(1) + j].long() << j) * (j < p.unsqueeze(1))
            prev = prev + 1 + (((stop - pos) << p) + low.sum(1))
            out[rice, i] = prev
            pos = stop + 1 + p
    return out, nl + code_bytes(total, 1)
