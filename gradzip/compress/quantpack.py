"""Shared parts of the stochastic quantisers ``qsgd``, ``terngrad`` and ``natural``: dense b-bit
codes, decode tables, and the per-rank deterministic rounding streams.

Codes: n codes of b bits (1 <= b <= 16) take ``ceil(n * b / 8)`` bytes. Bit j of code i is bit
``i * b + j`` of the stream, little-endian within a byte as in :mod:`gradzip.compress.bitpack`
(so b = 1 is ``bitpack.pack``); the padding bits of the last byte are zero. On the CPU numpy's
unpackbits/packbits do it (widths 1, 2 and 4: shifts of whole bytes), with no Python loop over
elements; other devices use the equivalent torch ops.

Decoding is a table lookup: a table of 2**b values (computed in fp64, clamped to the output dtype's
finite range, so that rounding never turns a finite gradient into inf; inf and NaN in the table,
which come from a non-finite scale, stay what they are) indexed by the codes.

Rounding streams (:class:`StochasticCode`): the random numbers of one ``compress`` call come from a
``torch.Generator`` seeded with ``blake2b(seed / key / step / digest / n)``, where ``step`` counts
the calls for ``key`` (the compressor's state: ``state_dict`` holds it, and a skipped step undoes it)
and ``digest`` is the int64 sum of the tensor's bit patterns (exact: the same in every process,
whatever the summation order). So ranks with different gradients round
independently (averaging over ranks reduces the variance) without knowing their rank, while a rank
draws the same numbers on ``sim``, gloo and MPI, and after a resume. Ranks whose tensors are equal
bit for bit draw the same numbers: still unbiased, without the variance reduction between them.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradzip.compress import bitpack
from gradzip.compress.base import Compressor, KeyCounters


def code_bytes(n: int, bits: int) -> int:
    """Bytes of ``n`` codes of ``bits`` bits each."""
    return (n * bits + 7) // 8


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack the 1-D integer tensor ``codes`` (each in ``[0, 2**bits)``, 1 <= bits <= 16) into uint8."""
    if not 1 <= bits <= 16:
        raise ValueError(f"codes of {bits} bits: 1 to 16 are supported")
    if bits == 8:
        return codes.to(torch.uint8)
    if codes.device.type == "cpu" and 8 % bits == 0:  # 1, 2, 4: whole codes per byte, shift-or them
        per = 8 // bits
        g = np.zeros((-(-codes.numel() // per), per), np.uint8)
        g.reshape(-1)[:codes.numel()] = codes.numpy()
        out = g[:, 0].copy()
        for k in range(1, per):
            out |= g[:, k] << np.uint8(k * bits)
        return torch.from_numpy(out)
    if codes.device.type == "cpu":  # any width: via a bit matrix, numpy's SIMD bit kernels
        c = codes.numpy().astype(np.uint8 if bits < 8 else np.dtype("<u2"))
        b = np.unpackbits(c.view(np.uint8).reshape(c.size, c.itemsize), axis=1, bitorder="little")
        return torch.from_numpy(np.packbits(b[:, :bits], bitorder="little"))  # rows in order
    return _pack_torch(codes, bits)


def _pack_torch(codes: Tensor, bits: int) -> Tensor:  # any device; used off the CPU
    shifts = torch.arange(bits, device=codes.device, dtype=codes.dtype)
    return bitpack.pack((codes.unsqueeze(1) >> shifts) & 1)


def unpack_codes(packed: Tensor, n: int, bits: int) -> Tensor:
    """Inverse of :func:`pack_codes`: the ``n`` codes as a 1-D int32 tensor."""
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != code_bytes(n, bits):
        raise ValueError(f"expected {code_bytes(n, bits)} packed uint8 bytes for {n} codes of {bits} bits, "
                         f"got {packed.dtype} of shape {tuple(packed.shape)}")
    if bits == 8:
        return packed.to(torch.int32)
    if packed.device.type == "cpu" and 8 % bits == 0:
        shifts = np.arange(0, 8, bits, dtype=np.uint8)
        c = (packed.numpy()[:, None] >> shifts) & np.uint8((1 << bits) - 1)
        return torch.from_numpy(c.reshape(-1)[:n].astype(np.int32))
    if packed.device.type == "cpu":
        b = np.unpackbits(packed.numpy(), count=n * bits, bitorder="little").reshape(n, bits)
        c = np.packbits(b, axis=1, bitorder="little")  # (n, 1) or (n, 2) bytes, zero-padded high bits
        return torch.from_numpy((c if bits < 8 else c.view("<u2")).reshape(-1).astype(np.int32))
    return _unpack_torch(packed, n, bits)


def _unpack_torch(packed: Tensor, n: int, bits: int) -> Tensor:  # any device; used off the CPU
    shifts = torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (bitpack.unpack(packed, n * bits).view(n, bits).to(torch.int32) << shifts).sum(1).to(torch.int32)


def lookup(table: Tensor, codes: Tensor, dtype: torch.dtype) -> Tensor:
    """``table[codes]`` in ``dtype``; finite table values are clamped to ``dtype``'s range first."""
    big = torch.finfo(dtype).max
    table = torch.where(torch.isfinite(table), table.clamp(-big, big), table).to(dtype)
    return torch.index_select(table, 0, codes.to(table.device))


class StochasticCode(KeyCounters, Compressor):
    """Base of the unbiased element-wise quantisers: an allgather of per-rank codes (decodable
    with any rank's context, hence also ``twophase``), and a per-key call counter as the state."""

    collective = "allgather"
    schemes = ("allgather", "twophase")
    biased = False
    host_syncs = "compress reads a digest of the gradient on the host to seed its rounding stream"

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.counters: dict[str, int] = {}

    def generator(self, flat: Tensor, key: str) -> torch.Generator:
        """This call's generator for the flat contiguous tensor ``flat`` (advances ``key``'s counter)."""
        step = self.next_count(key)
        n = flat.numel()
        digest = int(flat.view(bitpack.INT_VIEW[flat.dtype]).sum(dtype=torch.int64)) if n else 0
        text = f"{self.config.seed}/{key}/{step}/{digest}/{n}"
        seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
        return torch.Generator(device=flat.device).manual_seed(seed)


def check_seed(seed: int) -> None:
    """Raise ValueError unless ``seed`` is an integer >= 0."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, the same on every rank, e.g. 0; got {seed!r}")
