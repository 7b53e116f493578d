"""The compressor contract.

A compressor turns a *bucket* of gradient tensors into a *payload* (a tuple of tensors that cross
the wire) plus a local *context*, and turns a payload back into tensors of the original shapes
and dtypes.

Protocol, exactly as :class:`gradzip.engine.exchange.Exchange` drives it, once per bucket and
step (``tensors``: the bucket's gradients, in bucket order; ``key``: the bucket's state key)::

    payload, ctx = c.compress_batch(tensors, key)          # round 0, on the compute thread
    for r in range(1, c.rounds):                           # multi-round compressors (PowerSGD)
        reduced = tuple(allreduce_mean(p) for p in payload)
        payload, ctx = c.next_round_batch(reduced, ctx)
    if c.collective == "allreduce":                        # payloads average elementwise
        outs = c.decompress_batch(tuple(allreduce_mean(p) for p in payload), ctx)
    else:                                                  # "allgather": one payload per rank
        per_rank = allgather(payload)                      # list over ranks of payload tuples
        parts = [c.decompress_batch(p, ctx) for p in per_rank]
        outs = [c.aggregate([part[i] for part in parts]) for i in range(len(tensors))]
    # outs[i] is the averaged gradient of tensors[i] (same shape and dtype)

The ``*_batch`` methods are the protocol. Element-wise compressors implement only the
single-tensor methods (``compress``, ``decompress``, ``next_round``): the defaults below view the
bucket as one flat tensor. Compressors whose unit is a tensor or a matrix (PowerSGD; error feedback,
which wraps any compressor) derive from :class:`BucketCompressor` and implement the ``*_batch``
methods, and declare ``per_tensor = True`` when the engine must give them tensors one parameter
each rather than one flat view.

Capabilities, declared on the class (the engine, the DDP adapter and ``gradzip simulate`` read
them; nothing outside guesses from the type or unwraps ``.inner``):

- ``collective``: how payloads combine, ``"allreduce"`` or ``"allgather"``;
- ``schemes``: every exchange scheme the compressor supports (default: its ``collective``); the
  instance's ``exchange`` is the one chosen (spec ``exchange=...``, default: the collective).
  ``twophase`` needs a compressor whose payload of a chunk decodes with any rank's context of the
  same chunk size and key (element-wise codes); ``sparse`` needs a ``(values, indices)`` payload
  of flat indices into the bucket (top-k);
- ``per_tensor``: the bucket arrives as per-parameter tensors (PowerSGD) instead of one flat view;
- ``identity``: the payload is the gradient itself (``none``): small tensors then ride in the same
  buckets as large ones, and there is nothing to encode;
- ``fixed_size``: the payload's shapes follow from the bucket's shapes and dtype alone (so they are
  the same on every rank, and the allgather needs no size exchange: ``same_shape=True``);
- ``own_ef``: the compressor keeps its own error feedback (``demo``: its momentum keeps what was
  not sent), so ``ef=true`` and ``ef=ef21`` would stack a second memory on it: the registry
  ignores them, with a warning;
- ``rounds``, ``biased``, ``lossless``, ``default_ef``.

:class:`gradzip.compress.ef.ErrorFeedback` delegates each of them to the compressor it wraps,
except ``identity`` (its payload is the compensated gradient, not the gradient).

Rules every compressor follows:

- ``collective == "allreduce"`` only if the elementwise *mean* of the ranks' payloads decompresses
  to the mean of the ranks' reconstructions (linear codes: casts, shared-seed random-k, PowerSGD).
- For ``allgather`` compressors, ``ctx`` holds only what every rank knows identically (shape,
  dtype, numel): it is used to decompress *other* ranks' payloads.
- ``payload_bytes(shape, dtype)`` is exact for ``fixed_size`` compressors: it equals the sum of
  ``t.numel() * t.element_size()`` over the payload tensors of every round. A data-dependent size
  (``threshold``) makes it an upper bound (or, for DGC's warm-up, the steady state), which is what
  ``gradzip simulate`` plans for; the engine counts what was really sent.
- Everything that persists between steps (error memory, PowerSGD's Q, RNG counters) is keyed by
  the ``key`` argument and returned by ``state_dict()``; values are tensors, numbers, strings,
  lists and dicts only, so checkpoints load with ``torch.load(weights_only=True)``.
- Compressors know nothing of communicators or backends.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from gradzip.compress import native

Payload = tuple[Tensor, ...]
Collective = Literal["allreduce", "allgather"]
# How the ranks' payloads are combined (see gradzip.engine.schemes): the compressor's own
# collective, the compressed allreduce of 1-bit Adam ("twophase"), or gTop-k ("sparse").
SCHEMES: tuple[str, ...] = ("allreduce", "allgather", "twophase", "sparse")


@dataclasses.dataclass
class NoConfig:
    """Config of a compressor without parameters."""


class Compressor(ABC):
    """Base class. Subclasses set the class attributes and implement the abstract methods.

    Class attributes:
        name: registry name (set by :func:`gradzip.compress.registry.register`).
        collective: ``"allreduce"`` or ``"allgather"``, see module docstring.
        biased: whether E[decompress(compress(x))] != x.
        description: one line for ``gradzip ls``.
        Config: a dataclass of parameters; its ``__post_init__`` validates ranges.
        default_ef: wrap in error feedback unless the spec says ``ef=false``.
        rounds: number of communication rounds (PowerSGD: 2).
        lossless: decompress(compress(x)) == x exactly (used by the generic tests).
        schemes: exchange schemes supported; defaults to ``(collective,)``.
        per_tensor: the ``*_batch`` methods want the bucket's tensors one per parameter.
        identity: the payload is the gradient itself (``none``).
        fixed_size: payload shapes depend only on the bucket's shapes and dtype (not its values).
        own_ef: the compressor is its own error feedback; ``ef=true``/``ef=ef21`` are ignored.
    """

    name: ClassVar[str] = ""
    collective: ClassVar[Collective] = "allreduce"
    biased: ClassVar[bool] = False
    description: ClassVar[str] = ""
    Config: ClassVar[type] = NoConfig
    default_ef: ClassVar[bool] = False
    rounds: ClassVar[int] = 1
    lossless: ClassVar[bool] = False
    schemes: ClassVar[tuple[str, ...]] = ("allreduce",)
    per_tensor: ClassVar[bool] = False
    identity: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True
    own_ef: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Undeclared in the class and its bases: the one scheme its collective gives.
        if not any("schemes" in k.__dict__ for k in cls.__mro__ if k is not Compressor):
            cls.schemes = (cls.collective,)

    def __init__(self, config: Any = None) -> None:
        self.config = config if config is not None else self.Config()
        self.exchange: str = self.collective  # the scheme in use; the registry sets it from the spec

    # ----------------------------------------------------------------- single tensor
    @abstractmethod
    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, Any]:
        """Encode ``tensor`` (any shape; fp32, fp16 or bf16). Does not modify ``tensor``."""

    def next_round(self, reduced: Payload, ctx: Any) -> tuple[Payload, Any]:
        """Multi-round compressors: produce the next round's payload from the reduced one."""
        raise NotImplementedError(f"{self.name} is a single-round compressor")

    @abstractmethod
    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        """Decode a payload into a tensor of the original shape and dtype."""

    def aggregate(self, tensors: list[Tensor]) -> Tensor:
        """Combine the ranks' decompressed tensors (allgather compressors). Default: mean."""
        out = tensors[0].clone()
        for t in tensors[1:]:
            out += t
        return out.div_(len(tensors))

    @abstractmethod
    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        """Exact payload bytes, summed over all rounds, for one tensor of ``shape``."""

    # ----------------------------------------------------------------- buckets (the protocol)
    # The engine hands a compressor a whole bucket. Element-wise compressors see it as one flat
    # tensor (the defaults below); PowerSGD overrides these to work per matrix, batched by shape.
    def compress_batch(self, tensors: Sequence[Tensor], key: str = "") -> tuple[Payload, Any]:
        """Encode a bucket (round 0). Does not modify ``tensors`` (error feedback keeps its own
        memory); the payload may alias them (``none``), which the Exchange contract allows."""
        flat = flatten(tensors)
        payload, ctx = self.compress(flat, key)
        return payload, _BatchCtx(ctx, [t.shape for t in tensors])

    def next_round_batch(self, reduced: Payload, ctx: Any) -> tuple[Payload, Any]:
        """Multi-round compressors: the next round's payload from the averaged one."""
        payload, inner = self.next_round(reduced, ctx.inner)
        return payload, _BatchCtx(inner, ctx.shapes)

    def decompress_batch(self, payload: Payload, ctx: Any) -> list[Tensor]:
        """Decode the last round's payload (averaged, or one rank's for allgather) into tensors of
        the bucket's shapes and dtypes."""
        return unflatten(self.decompress(payload, ctx.inner), ctx.shapes)

    def batch_payload_bytes(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32) -> int:
        """Exact payload bytes for a bucket of tensors with these shapes."""
        return self.payload_bytes(sum(_numel(s) for s in shapes), dtype)

    def subtract_sent(self, payload: Payload, ctx: Any, flat: Tensor) -> bool:
        """Error feedback's step 4 fused: ``flat -= decompress(payload)`` in place, where ``flat`` is
        the fp32 tensor that ``payload`` was compressed from (the compensated bucket, read flat).
        Return False (the default) when not implemented: error feedback then decodes into a new
        buffer and subtracts. An implementation must give the same floats as that path."""
        return False

    def subtract_sent_batch(self, payload: Payload, ctx: Any, flat: Tensor) -> bool:
        """:meth:`subtract_sent` for a bucket compressed by the default :meth:`compress_batch`."""
        return isinstance(ctx, _BatchCtx) and self.subtract_sent(payload, ctx.inner, flat)

    def compress_subtract(self, tensor: Tensor, key: str = "") -> tuple[Payload, Any] | None:
        """Error feedback's encode and residual in one pass: :meth:`compress` ``tensor`` (flat,
        fp32) and turn it into ``tensor − decompress(payload)`` while reading it (mutates its input
        into the error buffer). None (the default; nothing touched) when not implemented: error
        feedback then compresses and calls :meth:`subtract_sent`. An implementation must give the
        same payload and floats as that path (1-bit codes: a C kernel, see ``native``)."""
        return None

    def compress_subtract_batch(self, flat: Tensor, shapes: Sequence[torch.Size], key: str = "") \
            -> tuple[Payload, Any] | None:
        """:meth:`compress_subtract` for a bucket whose tensors lie back to back in ``flat``."""
        if type(self).compress_batch is not Compressor.compress_batch:
            return None
        out = self.compress_subtract(flat, key)
        return None if out is None else (out[0], _BatchCtx(out[1], list(shapes)))

    #: Error feedback keeps the residual against the *reduced* result this rank decodes (its
    #: :meth:`decompress_batch` output) rather than against its own payload: for multi-round
    #: allreduce compressors whose decode already computes the approximation (PowerSGD's
    #: ``residual=reduced``), which saves decoding the local payload. See :meth:`subtract_output`.
    residual_from_output: bool = False

    def subtract_output(self, out: list[Tensor], ctx: Any, memory: list[Tensor]) -> bool:
        """With :attr:`residual_from_output`: ``memory`` (the compensated tensors, fp32) minus
        ``out`` (this rank's decode of the reduced payload), in place; the default subtracts every
        tensor. Override it where some tensors travel exactly (their residual is zero). True when
        the non-finite entries of the result are zeroed too (:func:`sub_finite_`): error feedback
        then skips that pass."""
        return all([sub_finite_(m, o) for m, o in zip(memory, out)])

    def sent_proves_finite(self, payload: Payload, ctx: Any) -> bool:
        """True when ``payload`` shows, at no cost and without a device sync, that every entry of
        the tensor it was compressed from is finite (top-k: the largest magnitudes are finite, and
        the selection ranks inf and NaN first). Error feedback then skips its pass that zeroes
        non-finite residual entries. False (the default): not known, the pass runs."""
        return False

    def sent_proves_finite_batch(self, payload: Payload, ctx: Any) -> bool:
        """:meth:`sent_proves_finite` for a bucket compressed by the default :meth:`compress_batch`."""
        return isinstance(ctx, _BatchCtx) and self.sent_proves_finite(payload, ctx.inner)

    def decode_aggregate(self, payloads: list[Payload], ctx: Any) -> Tensor | None:
        """``aggregate([decompress(p, ctx) for p in payloads])`` in one pass, without a full-size
        decode per rank (allgather compressors: the ranks' payloads in rank order). None (the
        default) when not implemented: the exchange then decodes each payload and aggregates.
        An implementation must give the same floats as that path, and be a pure function of the
        payloads and ``ctx`` (no state read or changed): ``sim`` workers that gathered the same
        payloads share one call's result."""
        return None

    def decode_aggregate_batch(self, payloads: list[Payload], ctx: Any) -> list[Tensor] | None:
        """:meth:`decode_aggregate` for buckets compressed by the default :meth:`compress_batch`."""
        if not isinstance(ctx, _BatchCtx):
            return None
        out = self.decode_aggregate(payloads, ctx.inner)
        return None if out is None else unflatten(out, ctx.shapes)

    def credit(self, key: str, indices: Tensor, values: Tensor) -> None:
        """An exchange scheme dropped ``values`` of this rank's own payload of ``key``, at flat
        ``indices`` of the bucket (``exchange=sparse``). Error feedback adds them back to its
        memory; a compressor without memory has nowhere to keep them and ignores them."""

    def ef_caveat(self) -> str | None:
        """A warning to show when this configuration is wrapped in error feedback, or None."""
        return None

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything that persists between steps, as a snapshot that later steps do not change
        (copies, not the live tensors). Stateless compressors return ``{}``."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{self.name} is stateless but got state keys {sorted(state)}")

    # ----------------------------------------------------------------- steps that may be undone
    # The engine skips a step on every rank when some rank's gradient is not finite; the state
    # updates of that step (error memory, Q, counters) must then not happen either.
    def begin_step(self) -> None:
        """Open a step whose state updates :meth:`end_step` may undo. Default: remember a
        ``state_dict()`` snapshot (cheap for small states: Q, counters); error feedback instead
        double-buffers its memory, so that neither outcome costs a copy."""
        self._undo = self.state_dict()

    def end_step(self, keep: bool) -> None:
        """Close the step opened by :meth:`begin_step`: keep its state updates, or undo them.
        Without an open step (a caller that never calls ``begin_step``) it does nothing."""
        undo = self.__dict__.pop("_undo", None)
        if not keep and undo is not None:
            self.load_state_dict(undo)

    # ----------------------------------------------------------------- state by key
    # A caller whose buckets change (DDP rebuilds its buckets after the first step) moves each
    # parameter's residual to its new key and frees the old keys.
    def residuals(self, key: str) -> list[Tensor] | None:
        """The error memory of ``key``, one tensor per tensor of the bucket (views), or None
        (no memory for it, or a compressor without memory)."""
        return None

    def set_residuals(self, key: str, tensors: Sequence[Tensor]) -> None:
        """Make ``tensors`` (copied) the error memory of ``key``. Compressors without memory ignore it."""

    def forget(self, key: str) -> None:
        """Drop every state entry of ``key`` (the key itself and its sub-keys ``key/...``)."""

    # ----------------------------------------------------------------- misc
    @property
    def spec(self) -> str:
        """Canonical spec string, e.g. ``topk:ratio=0.01``; parses back to an equal compressor."""
        # Unwrapped, a class that defaults to error feedback must say ef=false, or its spec would
        # parse back wrapped in EF.
        return self._spec_with("false" if self.default_ef else None)

    def _spec_with(self, ef: str | None) -> str:
        params = [f"{f.name}={_fmt(getattr(self.config, f.name))}" for f in dataclasses.fields(self.config)]
        if ef is not None:
            params.append(f"ef={ef}")
        if self.exchange != self.collective:
            params.append(f"exchange={self.exchange}")
        return f"{self.name}:{','.join(params)}" if params else self.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec}>"


class KeyCounters:
    """State of compressors whose randomness advances per key: ``counters[key]`` counts the calls
    (random-k's shared indices, the stochastic quantisers' rounding streams)."""

    counters: dict[str, int]

    def next_count(self, key: str) -> int:
        """This call's count for ``key`` (0 first), advancing it."""
        step = self.counters.get(key, 0)
        self.counters[key] = step + 1
        return step

    def forget(self, key: str) -> None:
        for k in [k for k in self.counters if key_under(k, key)]:
            del self.counters[k]

    def state_dict(self) -> dict[str, Any]:
        return {"counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters = {str(k): int(v) for k, v in state.get("counters", {}).items()}


class ReplacedState:
    """State of compressors that keep one tensor per key and *replace* it each step, never writing
    a stored tensor in place (DeMo's momentum δ): an undone step restores the old references, at no
    copy. ``state_dict()`` is ``{state_key: {key: copy}}``. Per-tensor compressors key tensor i of
    a bucket ``key`` as ``key/i``: :meth:`residuals` gives them in order (DDP's bucket rebuild
    carries them over), :meth:`set_residuals` sets them (flat fp32 copies)."""

    state: dict[str, Tensor]
    state_key: ClassVar[str] = "state"

    def begin_step(self) -> None:
        self._undo = dict(self.state)

    def end_step(self, keep: bool) -> None:
        undo = self.__dict__.pop("_undo", None)
        if not keep and undo is not None:
            self.state = undo

    def forget(self, key: str) -> None:
        self.state = {k: v for k, v in self.state.items() if not key_under(k, key)}

    def residuals(self, key: str) -> list[Tensor] | None:
        mine = [self.state.get(f"{key}/{i}") for i in range(sum(key_under(k, key) for k in self.state))]
        return mine if mine and all(m is not None for m in mine) else None  # type: ignore[return-value]

    def set_residuals(self, key: str, tensors: Sequence[Tensor]) -> None:
        self.forget(key)
        self.state.update({f"{key}/{i}": t.detach().float().reshape(-1).clone() for i, t in enumerate(tensors)})

    def state_dict(self) -> dict[str, Any]:
        return {self.state_key: {k: v.clone() for k, v in self.state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) - {self.state_key}:
            raise ValueError(f"{getattr(self, 'name', '')}: unexpected state keys {sorted(state)}; "
                             f"expected {self.state_key!r}")
        self.state = {str(k): v.clone() for k, v in state.get(self.state_key, {}).items()}


class BucketCompressor(Compressor):
    """Base for compressors whose native unit is a bucket of tensors (PowerSGD works per matrix,
    error feedback per tensor): they implement the ``*_batch`` methods, and a single tensor is a
    bucket of one. Set ``per_tensor = True`` to receive one tensor per parameter."""

    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, Any]:
        return self.compress_batch([tensor], key)

    def next_round(self, reduced: Payload, ctx: Any) -> tuple[Payload, Any]:
        return self.next_round_batch(reduced, ctx)

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        return self.decompress_batch(payload, ctx)[0]


@dataclasses.dataclass
class _BatchCtx:
    inner: Any
    shapes: list[torch.Size]


def _numel(shape: Sequence[int] | int) -> int:
    if isinstance(shape, int):
        return shape
    n = 1
    for d in shape:
        n *= int(d)
    return n


def numel_of(shape: Sequence[int] | int) -> int:
    """Number of elements of a shape (or an int, returned as is)."""
    return _numel(shape)


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """One contiguous 1-D tensor: a view when the tensors are consecutive contiguous pieces of one
    buffer (the engine's buckets, EF's memory), else a copy."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    span = _consecutive_span(tensors)
    if span is not None:
        return span
    return torch.cat([t.reshape(-1) for t in tensors])


def _consecutive_span(tensors: Sequence[Tensor]) -> Tensor | None:
    first = tensors[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device for t in tensors):
        return None
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return None
        offset += t.numel()
    total = offset - first.storage_offset()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (total,))


def cast_saturating(t: Tensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """``t`` cast to ``dtype``, with finite values clamped to ``dtype``'s range, so that rounding on
    the wire (bf16 rounds 65504 up to 65536) never turns a finite fp16 gradient into inf; inf and
    NaN stay what they are (a GradScaler must still see them). Only fp16 targets pay for it (three
    elementwise passes): bf16's range is fp32's but for its last 0.3 %, so other casts are plain."""
    if dtype != torch.float16 or t.dtype == torch.float16:
        return t.to(dtype) if out is None else out.copy_(t)
    big = torch.finfo(dtype).max
    wide = t.float()  # clamp in fp32: bf16 cannot even hold fp16's max
    clamped = torch.where(torch.isfinite(wide), wide.clamp(-big, big), wide)
    return clamped.to(dtype) if out is None else out.copy_(clamped)


def key_under(key: str, prefix: str) -> bool:
    """``key`` is ``prefix`` or one of its sub-keys (``prefix/...``): what :meth:`Compressor.forget` drops."""
    return key == prefix or key.startswith(prefix + "/")


def unflatten(flat: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    """Views of ``flat`` with the given shapes."""
    out, offset = [], 0
    for s in shapes:
        n = _numel(s)
        out.append(flat[offset:offset + n].view(s))
        offset += n
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def sub_finite_(m: Tensor, t: Tensor) -> bool:
    """``m -= t``; True when the non-finite entries of the result were zeroed in the same pass (the
    fused kernel, :func:`gradzip.compress.native.sub_finite`), False when only subtracted."""
    if native.sub_finite(m, t):
        return True
    m.sub_(t)
    return False
