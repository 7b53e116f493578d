"""Error feedback (EF), a wrapper usable with any compressor.

Algorithm (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019), per key:

1. compensated = gradient + memory
2. payload = inner.compress(compensated)
3. transmitted = inner.decompress(own final payload)  (what this rank contributed)
4. memory = compensated − transmitted                   (the new residual)

Invariant: ``compensated == transmitted + memory``. For multi-round compressors (PowerSGD), steps
3–4 happen on the last round's *local* payload (P Q_localᵀ). The authors' code (Vogels et al. 2019)
and torch's PowerSGD hook keep the residual against the *reduced* Q instead, the approximation the
decode computes anyway (one full-size matmul fewer per step): compressors that declare
``residual_from_output`` (``powersgd:residual=reduced``) get that form, the memory being updated
when the reduced payload is decoded. Both leave the same mean residual over ranks, since the mean
of the local Qs is the reduced Q; per rank, the invariant then holds against the reduced result.

The memory is kept in fp32 whatever the gradient's dtype, so that small residuals of bf16/fp16
gradients are not rounded away; the output is cast back to the gradient's dtype. ``memory_dtype``
(``ErrorFeedback(inner, memory_dtype=torch.bfloat16)``, what ``fsdp_compress(ef_dtype=...)``
builds) stores it in a lower precision instead, half of fp32's bytes: steps 1-4 still run in fp32,
in a temporary of the bucket's size, and step 4 rounds the new residual into the stored memory
(what that dtype cannot hold of the residual is lost; non-finite entries, an fp16 overflow
included, become 0 at the next step).

Steps that may be undone (:meth:`Compressor.begin_step`; the engine opens one per step so that a
step with a non-finite gradient on any rank is skipped everywhere): the memory is double-buffered.
Step 1 writes ``gradient + memory`` into a second buffer instead of into the memory (the same
passes as in place), so keeping the step is a swap of the two and undoing it costs nothing. The
price is a second fp32 buffer of the compressed gradients' size per worker. Callers that never
open a step (the DDP hook) get the in-place update and a single buffer. With ``memory_dtype`` the
two buffers are of that dtype, and a step writes its rounded residual into the second one: no step
copies the memory, and undoing it leaves the memory untouched.
Decay (``ef_decay=β``, default 1): step 1 becomes compensated = gradient + β·memory (the memory
is scaled, then the gradient added), SparseLoCo's e ← β e + Δ. β = 1 runs the passes above unchanged.
Spelling: ``"topk:ratio=0.01,ef=true"``, ``"sparseloco:ef=true,ef_decay=0.95"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradzip.compress.base import Compressor, Payload, cast_saturating, flatten, key_under, sub_finite_, unflatten
from gradzip.compress.fastpaths import (
    BucketCompressor,
    CompressSubtract,
    Credit,
    DecodeAggregate,
    ProvesFinite,
    ResidualFromOutput,
    SubtractSent,
)


@dataclass
class _EFCtx:
    inner: Any
    key: str
    compensated: list[Tensor] | None  # kept only until the last round for multi-round inners
    dtypes: list[torch.dtype]
    round: int = 0
    flat: Tensor | None = None  # the buffer behind ``compensated``
    store: Tensor | None = None  # memory_dtype: the low-precision buffer the residual is rounded into


def _unalias(payload: Payload, buffers: Sequence[Tensor]) -> Payload:
    """Clone payload tensors that share storage with the memory buffers (lossless inners such as
    ``none`` return a view of their input), since the buffers are overwritten with the residual."""
    ptrs = {b.untyped_storage().data_ptr() for b in buffers if b.numel()}
    return tuple(p.clone() if p.numel() and p.untyped_storage().data_ptr() in ptrs else p for p in payload)


class ErrorFeedback(DecodeAggregate, Credit, BucketCompressor):
    """Wraps ``inner``; holds one residual list per key, in ``memory_dtype`` (fp32 by default; a
    floating dtype). Takes the inner compressor's optional paths (:mod:`gradzip.compress.fastpaths`)
    where it has them, else the core path."""

    def __init__(self, inner: Compressor, memory_dtype: torch.dtype = torch.float32, decay: float = 1.0) -> None:
        super().__init__(inner.config)
        if not memory_dtype.is_floating_point:
            raise ValueError(f"error feedback: memory_dtype must be a floating dtype, got {memory_dtype}")
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"ef_decay must be in [0, 1], e.g. 0.95; got {decay!r}")
        self.inner = inner
        self.memory_dtype = memory_dtype
        self.decay = float(decay)  # the memory's factor in step 1
        self.memory: dict[str, list[Tensor]] = {}  # per key: views of self._flat[key]
        self._flat: dict[str, Tensor] = {}
        # An open step (begin_step): key -> (flat, views) holding this step's new memory, and
        # spare buffers to reuse; both None outside a step.
        self._pending: dict[str, tuple[Tensor, list[Tensor]]] | None = None
        self._spare: dict[str, tuple[Tensor, list[Tensor]]] = {}
        # Delegate the inner compressor's declarations (the engine reads these, never .inner).
        # Not `identity`: the payload is the compensated gradient, not the gradient.
        self.name = inner.name
        self.collective = inner.collective
        self.schemes = inner.schemes
        self.exchange = inner.exchange
        self.per_tensor = inner.per_tensor
        self.fixed_size = inner.fixed_size
        self.rounds = inner.rounds
        self.biased = inner.biased
        self.lossless = inner.lossless
        self.host_syncs = inner.host_syncs
        self.description = inner.description
        self.Config = inner.Config
        self.residual_from_output = isinstance(inner, ResidualFromOutput) and inner.residual_from_output
        if self.residual_from_output and (inner.collective != "allreduce" or inner.rounds < 2):
            raise ValueError(f"{inner.name}: a residual against the reduced result needs a multi-round "
                             "allreduce compressor (each rank decodes the reduced payload once)")

    @property
    def spec(self) -> str:
        spec = self.inner._spec_with("true")
        return spec if self.decay == 1.0 else f"{spec},ef_decay={self.decay}"


    def _memory_for(self, key: str, tensors: Sequence[Tensor]) -> list[Tensor]:
        """This key's residuals: ``memory_dtype`` views of one flat buffer (so batching compressors
        such as PowerSGD see neighbouring matrices, and flatten() needs no copy), on the tensors' device."""
        mem = self.memory.get(key)
        device = tensors[0].device if tensors else torch.device("cpu")
        same_shapes = mem is not None and [m.shape for m in mem] == [t.shape for t in tensors]
        if same_shapes and (not mem or mem[0].device == device):
            return mem  # type: ignore[return-value]
        flat = torch.zeros(sum(t.numel() for t in tensors), dtype=self.memory_dtype, device=device)
        if same_shapes and mem:  # e.g. loaded on the CPU, training on CUDA: keep the residual
            flat.copy_(flatten(mem))
        mem = unflatten(flat, [t.shape for t in tensors])
        self.memory[key], self._flat[key] = mem, flat
        return mem

    def _working(self, key: str, tensors: Sequence[Tensor]) -> tuple[Tensor, list[Tensor], Tensor | None]:
        """Step 1: compensated = gradient + memory, in the buffer that will hold the new residual:
        the memory itself, or in an open step its spare twin (the memory stays as it was). With a
        low-precision ``memory_dtype``, compensated is an fp32 temporary instead, and the third
        value is the buffer that the residual is rounded into (else None)."""
        mem = self._memory_for(key, tensors)
        fresh = self._pending is not None and key not in self._pending  # the step's first use of key
        if fresh:
            self._pending[key] = self._spare_for(key, mem)  # type: ignore[index]
        flat, views = (self._flat[key], mem) if self._pending is None else self._pending[key]
        if self.memory_dtype != torch.float32:
            work = torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
            works = unflatten(work, [m.shape for m in mem])
            for w, m, t in zip(works, mem if fresh else views, tensors):
                w.copy_(m).mul_(self.decay).add_(t) if self.decay != 1.0 else w.copy_(m).add_(t)  # fp32: exact copy
            return work, works, flat
        if self.decay != 1.0:  # β·memory, then + gradient (two passes, as e ← β e + Δ rounds)
            for o, m, t in zip(views, mem if fresh else views, tensors):
                torch.mul(m, self.decay, out=o).add_(t)
        elif fresh:
            for o, m, t in zip(views, mem, tensors):
                torch.add(m, t, out=o)
        else:
            for m, t in zip(views, tensors):
                m.add_(t)
        return flat, views, None

    def _spare_for(self, key: str, mem: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """The second buffer of ``key`` (that of an earlier step when it still fits), for a step's
        new residual."""
        flat, views = self._spare.pop(key, (None, []))
        if flat is None or flat.device != self._flat[key].device or flat.dtype != self._flat[key].dtype or \
                [v.shape for v in views] != [m.shape for m in mem]:
            flat = torch.empty_like(self._flat[key])
            views = unflatten(flat, [m.shape for m in mem])
        return flat, views

    @torch.no_grad()
    def compress_batch(self, tensors: Sequence[Tensor], key: str = "") -> tuple[Payload, Any]:
        # The working buffers become the compensated gradient in place (no per-step allocation)
        # and go back to holding the residual in _update_memory.
        flat, mem, store = self._working(key, tensors)
        fused = self.inner.compress_subtract_batch(flat, [m.shape for m in mem], key) \
            if self.inner.rounds == 1 and isinstance(self.inner, CompressSubtract) else None
        payload, inner_ctx = fused if fused is not None else self.inner.compress_batch(mem, key)
        payload = _unalias(payload, mem)
        ctx = _EFCtx(inner_ctx, key, mem, [t.dtype for t in tensors], flat=flat, store=store)
        if self.inner.rounds == 1:
            self._update_memory(payload, ctx, subtracted=fused is not None)
        return payload, ctx

    @torch.no_grad()
    def next_round_batch(self, reduced: Payload, ctx: Any) -> tuple[Payload, Any]:
        payload, inner_ctx = self.inner.next_round_batch(reduced, ctx.inner)
        payload = _unalias(payload, ctx.compensated)
        ctx = _EFCtx(inner_ctx, ctx.key, ctx.compensated, ctx.dtypes, ctx.round + 1, ctx.flat, ctx.store)
        if ctx.round == self.inner.rounds - 1 and not self.residual_from_output:
            self._update_memory(payload, ctx)
        return payload, ctx

    def _update_memory(self, payload: Payload, ctx: _EFCtx, subtracted: bool = False) -> None:
        # memory := compensated − transmitted, in place: fused by the compressor when it can (top-k
        # zeroes the sent entries, sign codes subtract ±scale, or already did while encoding:
        # ``subtracted``), else decode and subtract.
        assert ctx.flat is not None
        inner = self.inner
        cleaned = False  # the subtraction zeroed non-finite entries as it went (sub_finite_)
        if subtracted:
            pass
        elif self.residual_from_output:  # payload: the decode of the reduced result (decompress_batch)
            assert isinstance(inner, ResidualFromOutput)
            cleaned = bool(inner.subtract_output(list(payload), ctx.inner, ctx.compensated))
        elif not (isinstance(inner, SubtractSent) and inner.subtract_sent_batch(payload, ctx.inner, ctx.flat)):
            transmitted = inner.decompress_batch(payload, ctx.inner)
            cleaned = all([sub_finite_(m, t) for m, t in zip(ctx.compensated, transmitted)])
        # A non-finite gradient (an fp16 overflow step that the grad scaler skips) would poison the
        # memory for good: zero those entries (no host sync, unlike an isfinite().all() check),
        # unless that is done or the payload proves the compensated gradient finite (one pass saved).
        if not cleaned and not (isinstance(inner, ProvesFinite) and inner.sent_proves_finite_batch(payload, ctx.inner)):
            ctx.flat.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        if ctx.store is not None:  # memory_dtype: round the fp32 residual into the stored memory
            ctx.store.copy_(ctx.flat)
        ctx.compensated = ctx.flat = ctx.store = None

    def decompress_batch(self, payload: Payload, ctx: Any) -> list[Tensor]:
        out = self.inner.decompress_batch(payload, ctx.inner)
        if self.residual_from_output and ctx.flat is not None:  # memory := compensated − reduced result
            self._update_memory(tuple(out), ctx)
        return [cast_saturating(o, d) for o, d in zip(out, ctx.dtypes)]

    @torch.no_grad()
    def credit(self, key: str, indices: Tensor, values: Tensor) -> None:
        # Values the exchange dropped were subtracted from the memory as sent: add them back.
        flat = self._pending[key][0] if self._pending and key in self._pending else self._flat[key]
        flat.index_add_(0, indices.to(flat.device), values.to(flat.dtype))

    def begin_step(self) -> None:
        self.end_step(keep=True)  # a step left open is kept, as it would be without transactions
        self.inner.begin_step()
        self._pending = {}

    def end_step(self, keep: bool) -> None:
        pending, self._pending = self._pending, None
        self.inner.end_step(keep)
        for key, (flat, views) in (pending or {}).items():
            if keep:  # the new residual becomes the memory; the old memory the spare
                self._spare[key] = (self._flat[key], self.memory[key])
                self._flat[key], self.memory[key] = flat, views
            else:
                self._spare[key] = (flat, views)

    def aggregate(self, tensors: list[Tensor]) -> Tensor:
        return self.inner.aggregate(tensors)

    def decode_aggregate_batch(self, payloads: list[Payload], ctx: Any) -> list[Tensor] | None:
        # The decoded parts are cast to the gradients' dtypes before they are aggregated: the one
        # pass gives the same floats only when that cast is the identity (fp32 gradients).
        if not isinstance(self.inner, DecodeAggregate) or any(d != torch.float32 for d in ctx.dtypes):
            return None
        return self.inner.decode_aggregate_batch(payloads, ctx.inner)

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        # The inner compressor sees fp32 compensated gradients.
        return self.inner.payload_bytes(shape, torch.float32)

    def batch_payload_bytes(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32) -> int:
        return self.inner.batch_payload_bytes(shapes, torch.float32)

    def residuals(self, key: str) -> list[Tensor] | None:
        mem = self.memory.get(key)
        return None if mem is None else list(mem)

    def set_residuals(self, key: str, tensors: Sequence[Tensor]) -> None:
        flat = flatten(tensors).to(self.memory_dtype, copy=True) if tensors else torch.zeros(0, dtype=self.memory_dtype)
        self.memory[key], self._flat[key] = unflatten(flat, [t.shape for t in tensors]), flat
        self._spare.pop(key, None)

    def forget(self, key: str) -> None:
        self.inner.forget(key)
        for d in (self.memory, self._flat, self._spare):
            for k in [k for k in d if key_under(k, key)]:
                del d[k]

    def state_dict(self) -> dict[str, Any]:
        """The memory as of the last kept step (an open step's updates are not in it)."""
        return {"inner": self.inner.state_dict(), "memory": {k: [m.clone() for m in v] for k, v in self.memory.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))
        self.memory, self._flat, self._spare = {}, {}, {}
        self._pending = None if self._pending is None else {}
        for key, mems in state.get("memory", {}).items():
            self.set_residuals(key, [mems] if isinstance(mems, Tensor) else mems)  # a flat memory as one tensor
