"""The registry of exchange schemes: how the ranks' compressed payloads are combined.

One :class:`Scheme` per name holds everything its three users need, so that a new scheme is one
module and one :func:`register_scheme` call:

- the compressor registry (:mod:`gradzip.compress.registry`) checks that a compressor declares
  only registered names (its ``schemes``) and that a spec's ``exchange=`` is one of them;
- the engine (:class:`gradzip.engine.schemes.SchemeState`) builds the per-rank ``setup`` state
  once and, on more than one rank, exchanges each bucket with
  ``exchange(compressor, state, comm, tensors, key)``: an object with the interface of
  :class:`gradzip.engine.exchange.Exchange` (``start``, ``advance``, ``result``, ``rounds``,
  ``round``, ``compress_s``, ``link_s``);
- the cost model (:func:`gradzip.cluster.exchanges.flat_bucket`) prices a bucket with
  ``cost(comp, numel, dtype, cluster, codec, ready) -> (timing, bytes sent, link seconds)`` and
  books its link time under ``f"{name}_s"`` in ``ExchangeCost.detail``.

``exchange``, ``setup`` and ``cost`` are objects or ``"module:attr"`` strings, imported on first
use: this layer names the engine's and the cost model's code without importing it. A scheme whose
``exchange`` is None is the compressor's own collective (``allreduce``, ``allgather``), run by
:class:`~gradzip.engine.exchange.Exchange` and priced by the collective's formula. On one rank
every scheme falls back to that plain exchange.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

Ref = Any  # an object, or "module:attr" naming one


@dataclass(frozen=True)
class Scheme:
    """One exchange scheme (see the module docstring for the contract of each field).

    ``chunked``: the exchange compresses a bucket as n chunks, so the worker error memory of a
    bucket is kept per chunk (``key/j``); :class:`~gradzip.engine.schemes.SchemeState` moves it
    as one flat tensor. A ``setup`` state that is a compressor (``twophase``'s server) is owned by
    the scheme: checkpointed, forgotten with a bucket, and its steps undone with the engine's."""

    name: str
    exchange: Ref = None
    setup: Ref = None
    cost: Ref = None
    chunked: bool = False
    help: str = ""

    def exchange_class(self) -> Callable[..., Any] | None:
        """``exchange`` resolved: ``cls(compressor, state, comm, tensors, key)``, or None."""
        return resolve(self.exchange)

    def setup_state(self, compressor: Any, comm: Any) -> Any:
        """The per-rank state of this scheme for ``compressor`` over ``comm`` (None without ``setup``).
        Called on every rank at set-up, in the same order: it may split the communicator."""
        fn = resolve(self.setup)
        return None if fn is None else fn(compressor, comm)

    def cost_model(self) -> Callable[..., Any] | None:
        """``cost`` resolved, or None: the compressor's own collective's formula."""
        return resolve(self.cost)


@functools.cache
def _import(ref: str) -> Any:
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"scheme reference {ref!r}: expected 'package.module:attr'")
    return getattr(importlib.import_module(module), attr)


def resolve(ref: Ref) -> Any:
    """``ref`` itself, or the object a ``"module:attr"`` string names (imported once)."""
    return _import(ref) if isinstance(ref, str) else ref


_SCHEMES: dict[str, Scheme] = {}
BUILTIN = ("allreduce", "allgather", "twophase", "sparse")


def register_scheme(scheme: Scheme) -> Scheme:
    """Add ``scheme`` under its name; a name may be registered once (see :func:`unregister_scheme`)."""
    if not scheme.name or scheme.name != scheme.name.strip().lower() or "," in scheme.name or ":" in scheme.name:
        raise ValueError(f"scheme name {scheme.name!r}: use a lower-case word without ',' or ':'")
    if scheme.name in _SCHEMES:
        raise ValueError(f"exchange scheme {scheme.name!r} is registered already")
    if (scheme.exchange is None) != (scheme.cost is None):
        raise ValueError(f"scheme {scheme.name!r}: give both exchange and cost, or neither (the compressor's "
                         "own collective)")
    _SCHEMES[scheme.name] = scheme
    return scheme


def unregister_scheme(name: str) -> None:
    """Remove a scheme registered by :func:`register_scheme` (the built-in four stay)."""
    if name in BUILTIN:
        raise ValueError(f"exchange scheme {name!r} is built in and cannot be removed")
    if name not in _SCHEMES:
        raise ValueError(f"exchange scheme {name!r} is not registered")
    del _SCHEMES[name]


def get_scheme(name: str) -> Scheme:
    """The scheme registered under ``name``; ValueError naming the registered ones if none is."""
    try:
        return _SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown exchange scheme {name!r}; registered: {', '.join(_SCHEMES)}") from None


class SchemeNames(Sequence[str]):
    """The registered scheme names, in registration order: a live, read-only view."""

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...

    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        return tuple(_SCHEMES)[i]

    def __len__(self) -> int:
        return len(_SCHEMES)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_SCHEMES))

    def __contains__(self, name: object) -> bool:
        return name in _SCHEMES

    def __repr__(self) -> str:
        return repr(tuple(_SCHEMES))


SCHEME_NAMES = SchemeNames()

register_scheme(Scheme("allreduce", help="the compressor's payloads averaged elementwise"))
register_scheme(Scheme("allgather", help="every rank decodes the n-1 others' payloads"))
register_scheme(Scheme(
    "twophase", exchange="gradzip.engine.schemes:TwoPhaseExchange", setup="gradzip.engine.schemes:twophase_server",
    cost="gradzip.cluster.exchanges:twophase_bucket", chunked=True,
    help="the compressed allreduce of 1-bit Adam: alltoall of chunks, server re-encode, allgather"))
register_scheme(Scheme(
    "sparse", exchange="gradzip.engine.gtopk:SparseExchange", setup="gradzip.engine.gtopk:sparse_plan",
    cost="gradzip.cluster.exchanges:sparse_bucket",
    help="gTop-k: recursive doubling that keeps k entries at every level"))
