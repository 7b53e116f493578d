"""Optional paths of the compressor contract: what a compressor *may* implement beyond the core.

The core (:class:`gradzip.compress.base.Compressor`) is complete: the engine, error feedback and
every exchange scheme work with a compressor that implements nothing from this module. Each class
here is one optional path. A compressor opts in by inheriting the class and overriding its
method; the callers detect it with ``isinstance`` and otherwise take the core path.

Every one-pass path must give the same floats as the core path it replaces (bit for bit): results
never depend on whether a path was taken. ``tests/test_fastpaths.py`` checks it for every
registered compressor that implements one (``test_fast_paths_give_the_bits_of_the_core_path``
against the same compressor seen through the core contract alone, and one test per path).

- :class:`BucketCompressor`: the unit is a tensor or a matrix, not a flat bucket (PowerSGD, DeMo,
  error feedback): the compressor implements the ``*_batch`` methods itself.
- :class:`DecodeAggregate`: the mean of every rank's payload in one pass (allgather compressors),
  instead of a full-size decode per rank then ``aggregate``.
- :class:`SubtractSent`: error feedback's residual updated in place (``memory -= decoded``) from the
  payload, instead of decoding into a new buffer.
- :class:`CompressSubtract`: the encode and that update in the same pass over the bucket.
- :class:`ProvesFinite`: the payload shows that the compensated gradient was finite, so error
  feedback skips its pass that zeroes non-finite residual entries.
- :class:`ResidualFromOutput`: error feedback keeps the residual against the reduced result this
  rank decodes anyway (multi-round allreduce compressors: PowerSGD's ``residual=reduced``).
- :class:`Credit`: the compressor keeps a memory to which ``exchange=sparse`` returns the entries it
  dropped (error feedback).

The ``*_batch`` twin of each per-tensor method serves buckets encoded by the core's flat
:meth:`~gradzip.compress.base.Compressor.compress_batch`; a :class:`BucketCompressor` overrides
the twin instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradzip.compress.base import Compressor, Payload, _BatchCtx, sub_finite_, unflatten


class BucketCompressor(Compressor):
    """The batched path: compressors whose unit is a tensor or a matrix (PowerSGD works per matrix,
    batched by shape; DeMo per tensor; error feedback per tensor of its memory).

    Implement ``compress_batch``, ``next_round_batch`` (several rounds), ``decompress_batch`` and
    ``batch_payload_bytes``; a single tensor is then a bucket of one. Set ``per_tensor = True`` to
    receive the bucket as one tensor per parameter rather than one flat view. Tested by every
    generic test, which drives the bucket methods."""

    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, Any]:
        return self.compress_batch([tensor], key)

    def next_round(self, reduced: Payload, ctx: Any) -> tuple[Payload, Any]:
        return self.next_round_batch(reduced, ctx)

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        return self.decompress_batch(payload, ctx)[0]


class DecodeAggregate:
    """``aggregate([decompress(p, ctx) for p in payloads])`` in one pass, without a full-size decode
    per rank (allgather compressors: the ranks' payloads in rank order). Used by the exchange (and
    ``gradzip bench compress --aggregate``).

    Implement it when decoding dominates the exchange of many ranks: top-k's payloads go into one
    ``index_add_``, the sign codes' into one C loop. It must be a pure function of the payloads and
    ``ctx`` (no state read or changed): ``sim`` workers that gathered the same payloads share one
    call's result. Return None to decline (the exchange then decodes each payload and aggregates)."""

    def decode_aggregate(self, payloads: list[Payload], ctx: Any) -> Tensor | None:
        return None

    def decode_aggregate_batch(self, payloads: list[Payload], ctx: Any) -> list[Tensor] | None:
        """:meth:`decode_aggregate` for buckets compressed by the core's flat ``compress_batch``."""
        if not isinstance(ctx, _BatchCtx):
            return None
        out = self.decode_aggregate(payloads, ctx.inner)
        return None if out is None else unflatten(out, ctx.shapes)


class SubtractSent:
    """Error feedback's step 4 fused: ``flat -= decompress(payload)`` in place, where ``flat`` is the
    fp32 tensor that ``payload`` was compressed from (the compensated bucket, read flat).

    Implement it when the payload says what to subtract without a full-size decode (top-k zeroes
    the sent entries; a sign code subtracts ``copysign(scale, m)``). Return False to decline: error
    feedback then decodes into a new buffer and subtracts."""

    def subtract_sent(self, payload: Payload, ctx: Any, flat: Tensor) -> bool:
        return False

    def subtract_sent_batch(self, payload: Payload, ctx: Any, flat: Tensor) -> bool:
        """:meth:`subtract_sent` for a bucket compressed by the core's flat ``compress_batch``."""
        return isinstance(ctx, _BatchCtx) and self.subtract_sent(payload, ctx.inner, flat)


class CompressSubtract:
    """Error feedback's encode and residual in one pass: ``compress`` ``tensor`` (flat, fp32) and
    turn it into ``tensor − decompress(payload)`` while reading it (it mutates its input into the
    error buffer). Single-round compressors only.

    Implement it when one loop can do both (1-bit codes: a C kernel, see ``native``). Return None
    to decline, with nothing touched: error feedback then compresses and subtracts
    (:class:`SubtractSent` or a decode)."""

    def compress_subtract(self, tensor: Tensor, key: str = "") -> tuple[Payload, Any] | None:
        return None

    def compress_subtract_batch(self, flat: Tensor, shapes: Sequence[torch.Size], key: str = "") \
            -> tuple[Payload, Any] | None:
        """:meth:`compress_subtract` for a bucket whose tensors lie back to back in ``flat``."""
        if type(self).compress_batch is not Compressor.compress_batch:
            return None
        out = self.compress_subtract(flat, key)
        return None if out is None else (out[0], _BatchCtx(out[1], list(shapes)))


class ProvesFinite:
    """The payload shows, at no cost and without a device sync, that every entry of the tensor it
    was compressed from is finite (top-k: the largest magnitudes are finite, and the selection
    ranks inf and NaN first; a sign code: its scale mean|m| is finite).

    Implement it to spare error feedback its pass that zeroes non-finite residual entries. Return
    False when not known (the pass runs)."""

    def sent_proves_finite(self, payload: Payload, ctx: Any) -> bool:
        return False

    def sent_proves_finite_batch(self, payload: Payload, ctx: Any) -> bool:
        """:meth:`sent_proves_finite` for a bucket compressed by the core's flat ``compress_batch``."""
        return isinstance(ctx, _BatchCtx) and self.sent_proves_finite(payload, ctx.inner)


class ResidualFromOutput:
    """Error feedback keeps the residual against the *reduced* result this rank decodes (its
    ``decompress_batch`` output) rather than against its own payload: for multi-round allreduce
    compressors whose decode already computes the approximation (PowerSGD's ``residual=reduced``),
    which saves decoding the local payload. The memory is updated when the reduced payload is
    decoded.

    Set :attr:`residual_from_output` (per instance, from the config) to use it; override
    :meth:`subtract_output` where some tensors travel exactly (their residual is zero)."""

    residual_from_output: bool = False

    def subtract_output(self, out: list[Tensor], ctx: Any, memory: list[Tensor]) -> bool:
        """``memory`` (the compensated tensors, fp32) minus ``out`` (this rank's decode of the
        reduced payload), in place. True when the non-finite entries of the result are zeroed too
        (:func:`~gradzip.compress.base.sub_finite_`): error feedback then skips that pass."""
        return all([sub_finite_(m, o) for m, o in zip(memory, out)])


class Credit:
    """A memory for what an exchange scheme dropped: ``exchange=sparse`` (gTop-k) merges the ranks'
    top-k and drops some of this rank's entries; :meth:`credit` gives them back.

    Implement it in a compressor that keeps an error memory (error feedback does: it adds them to
    the memory). Without it the dropped values are lost, as they would be without memory."""

    def credit(self, key: str, indices: Tensor, values: Tensor) -> None:
        """``values`` of this rank's own payload of ``key``, at flat ``indices`` of the bucket, were
        dropped by the exchange."""
