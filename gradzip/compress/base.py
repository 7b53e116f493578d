"""The compressor contract: the small core every compressor implements.

A compressor turns a *bucket* of gradient tensors into a *payload* (a tuple of tensors that cross
the wire) plus a local *context*, and turns a payload back into tensors of the original shapes
and dtypes. A new compressor is one file in ``gradzip/compress/`` (the registry imports every
public module of the package and keeps the classes marked ``@register(name)``) with:

1. the capabilities, declared as class attributes (:data:`CAPABILITIES`; the engine, the DDP
   adapter, the registry and ``gradzip simulate`` read them, nothing guesses from the type);
2. ``compress(tensor, key) -> (payload, ctx)``: encode one tensor (any shape, fp32/fp16/bf16);
3. ``decompress(payload, ctx) -> tensor``: decode one payload, this rank's or another's;
4. ``payload_bytes(shape, dtype)``: the bytes it sends for such a tensor, over all rounds;
5. where it keeps anything between steps: ``state_dict`` / ``load_state_dict`` (default: stateless).

That is all: error feedback (``ef=true``), every exchange scheme it declares, checkpoints and every
generic test then work. ``gradzip/compress/scaledsign.py`` is the example, in about 40 lines.

How the engine drives it, once per bucket and step (``tensors``: the bucket's gradients, in bucket
order; ``key``: the bucket's state key), as :class:`gradzip.engine.exchange.Exchange` does::

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

The ``*_batch`` methods are provided: they view the bucket as one flat tensor and call the core
methods. Everything else is optional and lives in :mod:`gradzip.compress.fastpaths`: compressors
whose unit is a tensor or a matrix (PowerSGD, DeMo, error feedback) take the bucket methods over
(:class:`~gradzip.compress.fastpaths.BucketCompressor`), and a compressor may add one-pass paths
(decode and aggregate, fused error-feedback updates, ...) that its callers detect with
``isinstance`` and that must give the same floats as the core path.

Capabilities (class attributes):

- ``collective``: how payloads combine, ``"allreduce"`` or ``"allgather"``;
- ``schemes``: every exchange scheme the compressor supports (default: its ``collective``); the
  instance's ``exchange`` is the one chosen (spec ``exchange=...``, default: the collective).
  ``twophase`` needs a compressor whose payload of a chunk decodes with any rank's context of the
  same chunk size and key (element-wise codes); ``sparse`` needs a ``(values, indices)`` payload
  of flat indices into the bucket (top-k);
- ``biased``: whether E[decompress(compress(x))] != x;
- ``description``: one line for ``gradzip ls``;
- ``Config``: a dataclass of parameters; its ``__post_init__`` validates ranges, and the spec
  parser converts ``key=value`` to the fields' types;
- ``default_ef``: wrap in error feedback unless the spec says ``ef=false``;
- ``rounds``: number of communication rounds (PowerSGD: 2; then implement ``next_round``);
- ``lossless``: decompress(compress(x)) == x exactly (used by the generic tests);
- ``per_tensor``: the bucket arrives as per-parameter tensors (PowerSGD) instead of one flat view;
- ``identity``: the payload is the gradient itself (``none``): small tensors then ride in the same
  buckets as large ones, and there is nothing to encode;
- ``fixed_size``: the payload's shapes follow from the bucket's shapes and dtype alone (so they are
  the same on every rank, and the allgather needs no size exchange: ``same_shape=True``);
- ``own_ef``: the compressor keeps its own error feedback (``demo``: its momentum keeps what was
  not sent), so ``ef=true`` and ``ef=ef21`` would stack a second memory on it: the registry
  ignores them, with a warning.

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
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import Tensor

from gradzip.compress import native
from gradzip.compress.schemes import SCHEME_NAMES

Payload = tuple[Tensor, ...]
Collective = Literal["allreduce", "allgather"]
# How the ranks' payloads are combined (see gradzip.engine.schemes): the compressor's own
# collective, the compressed allreduce of 1-bit Adam ("twophase"), gTop-k ("sparse"), or any
# scheme registered later. A live view of the registry (gradzip.compress.schemes).
SCHEMES: Sequence[str] = SCHEME_NAMES


@dataclasses.dataclass
class NoConfig:
    """Config of a compressor without parameters."""


class ResidualState:
    """The step-undo and residual part of the compressor contract, inherited by
    :class:`Compressor` (so every compressor has it, and overrides what it keeps differently:
    :class:`ReplacedState`, :class:`KeyCounters`, error feedback). The defaults suit a compressor
    whose whole state is its ``state_dict()``: undo by snapshot, no error memory, nothing to forget."""

    if TYPE_CHECKING:  # given by the Compressor this is mixed into
        def state_dict(self) -> dict[str, Any]: ...

        def load_state_dict(self, state: dict[str, Any]) -> None: ...

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


class Compressor(ResidualState, ABC):
    """The core contract: the capabilities below, ``compress``, ``decompress`` and ``payload_bytes``
    (abstract), and, where the compressor has them, several rounds (``next_round``), its own way of
    combining the ranks' decodes (``aggregate``) and state (``state_dict``, ``load_state_dict``).
    The step undo and the residual moves (``begin_step`` ... ``forget``) come from
    :class:`ResidualState`.

    Algorithm of one step, on every rank, as the exchange runs it for one bucket:

    1. ``payload, ctx = compress(flat_bucket, key)``;
    2. for each further round: allreduce the payload (mean), ``payload, ctx = next_round(reduced, ctx)``;
    3. allreduce (mean) the last payload and ``decompress`` it; or, for ``"allgather"``, gather every
       rank's payload, ``decompress`` each with this rank's ``ctx`` and ``aggregate`` them (mean);
    4. the result is the bucket's averaged gradient, in its shapes and dtypes.

    The class attributes are the capabilities (see the module docstring; :data:`CAPABILITIES`).
    """

    name: ClassVar[str] = ""  # the registry name, set by @register
    collective: ClassVar[Collective] = "allreduce"
    schemes: ClassVar[tuple[str, ...]] = ("allreduce",)
    biased: ClassVar[bool] = False
    description: ClassVar[str] = ""
    Config: ClassVar[type] = NoConfig
    default_ef: ClassVar[bool] = False
    rounds: ClassVar[int] = 1
    lossless: ClassVar[bool] = False
    per_tensor: ClassVar[bool] = False
    identity: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True
    own_ef: ClassVar[bool] = False
    host_syncs: ClassVar[str] = ""  # why encoding waits for the device to report a value; "": never

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Undeclared in the class and its bases: the one scheme its collective gives.
        if not any("schemes" in k.__dict__ for k in cls.__mro__ if k is not Compressor):
            cls.schemes = (cls.collective,)

    def __init__(self, config: Any = None) -> None:
        self.config = config if config is not None else self.Config()
        self.exchange: str = self.collective  # the scheme in use; the registry sets it from the spec

    # ----------------------------------------------------------------- what a compressor implements
    @abstractmethod
    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, Any]:
        """Encode ``tensor`` (any shape; fp32, fp16 or bf16). Does not modify ``tensor``; the payload
        may alias it (``none``). ``key`` names the state this call may read and update."""

    @abstractmethod
    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        """Decode a payload (this rank's, a reduced one, or another rank's) into a tensor of the
        original shape and dtype."""

    @abstractmethod
    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        """Exact payload bytes, summed over all rounds, for one tensor of ``shape``."""

    def next_round(self, reduced: Payload, ctx: Any) -> tuple[Payload, Any]:
        """Multi-round compressors (``rounds > 1``): the next round's payload from the reduced one."""
        raise NotImplementedError(f"{self.name} is a single-round compressor")

    def aggregate(self, tensors: list[Tensor]) -> Tensor:
        """Combine the ranks' decompressed tensors (allgather compressors). Default: the mean, in
        rank order."""
        out = tensors[0].clone()
        for t in tensors[1:]:
            out += t
        return out.div_(len(tensors))

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

    # ----------------------------------------------------------------- a bucket (provided)
    # What the engine calls. Here the bucket is one flat tensor through the methods above; a
    # compressor whose unit is a tensor or a matrix overrides these four (fastpaths.BucketCompressor).
    def compress_batch(self, tensors: Sequence[Tensor], key: str = "") -> tuple[Payload, Any]:
        """Encode a bucket (round 0). Does not modify ``tensors`` (error feedback keeps its own
        memory); the payload may alias them (``none``), which the Exchange contract allows."""
        payload, ctx = self.compress(flatten(tensors), key)
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

    # ----------------------------------------------------------------- the spec
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


#: The capabilities a compressor declares (class attributes of :class:`Compressor`; ``name`` is
#: the registry's). docs/compressors.md lists each of them (tests/test_docs.py checks it).
CAPABILITIES: tuple[str, ...] = tuple(k for k in Compressor.__annotations__ if k != "name")


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
