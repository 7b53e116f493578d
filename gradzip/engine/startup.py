"""The start-up every bucketed synchroniser shares (:class:`gradzip.engine.Engine`,
:class:`gradzip.engine.diloco.DiLoCo`), in one place:

1. :func:`hosted`: the workers this process hosts (a :class:`SimWorld`'s N, or one rank);
2. :func:`start_up`: the bucket plan (:func:`gradzip.plan.buckets.assign_buckets`), the ranks'
   agreement on the model, the compressor spec and the options that decide the collectives
   (:func:`gradzip.engine.handshake.check_agreement`), rank 0's parameters and floating-point
   buffers on every rank (:func:`gradzip.engine.handshake.broadcast_state`), one compressor per
   hosted worker (each keeps its own state) and each worker's exchange scheme, bound;
3. :func:`scheme_for`: the exchange scheme of one compressor on one communicator, which a caller
   that holds several compressors per worker (a compressor per bucket) calls for each of them.

The order is the contract: buckets before the agreement (a bad plan fails locally first), the
agreement before any collective that depends on the settings, and the schemes last, because a
hierarchical scheme splits the communicator, which is only safe once every rank agreed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradzip.comm.base import Communicator
from gradzip.comm.sim import SimWorld
from gradzip.compress.base import Compressor
from gradzip.compress.registry import create
from gradzip.engine.config import INTRA_DTYPES
from gradzip.engine.handshake import broadcast_state, check_agreement, fingerprint
from gradzip.engine.hierarchical import HierarchicalScheme
from gradzip.engine.schemes import SchemeState
from gradzip.errors import GradzipError
from gradzip.plan.buckets import Bucket, assign_buckets

Scheme = SchemeState | HierarchicalScheme


@dataclass
class StartUp:
    """What a synchroniser starts from, identical in shape on every rank. ``compressors[i]`` and
    ``schemes[i]`` belong to the worker of ``comms[i]``; ``compressors[0]`` is the one passed in."""

    sim: bool
    comms: list[Communicator]
    spec: str
    buckets: list[Bucket]
    compressors: list[Compressor]
    schemes: list[Scheme]


def hosted(comm: Communicator | SimWorld, who: str = "") -> tuple[bool, list[Communicator]]:
    """``(sim, communicators)``: every worker of a :class:`SimWorld` (sim), or the one rank. With
    ``who``, anything else is a :class:`GradzipError` that names the caller; without, it is taken
    as a rank's communicator (duck-typed)."""
    if isinstance(comm, SimWorld):
        return True, list(comm.comms)
    if who and not isinstance(comm, Communicator):
        raise GradzipError(f"{who}: expected a Communicator or a SimWorld, got {type(comm).__name__}")
    return False, [comm]


def scheme_for(compressor: Compressor, comm: Communicator, hierarchical: bool = False,
               intra_dtype: str = "") -> Scheme:
    """The exchange scheme that carries ``compressor``'s payloads over ``comm``: the hierarchical
    one (reduce inside the node in ``intra_dtype``, one of :data:`INTRA_DTYPES`, compress across
    nodes) or the compressor's own. Not bound yet: call ``bind()`` on every worker's schemes once
    all of them exist (a hierarchical scheme splits the communicator, and sim binds the splits of
    every worker together)."""
    if hierarchical:
        return HierarchicalScheme(compressor, comm, INTRA_DTYPES[intra_dtype])
    return SchemeState(compressor, comm)


def fingerprint_options(bucket_cap_mb: float, min_compress_numel: int, hierarchical: bool,
                        intra_dtype: str) -> dict[str, Any]:
    """The options every bucketed synchroniser puts in the start-up fingerprint: those that decide
    the buckets and the collectives (a caller adds its own)."""
    return {"bucket_cap_mb": bucket_cap_mb, "min_compress_numel": min_compress_numel,
            "hierarchical": hierarchical, "intra_dtype": intra_dtype}


def start_up(model: torch.nn.Module, compressor: Compressor, comms: Sequence[Communicator], *, sim: bool,
             named: Sequence[tuple[str, torch.nn.Parameter]], cap_bytes: int, min_compress_numel: int,
             options: dict[str, Any], agree: dict[str, Any] | None = None, check: bool = True,
             broadcast: bool = True, hierarchical: bool = False, intra_dtype: str = "",
             on_plan: Callable[[list[Bucket]], None] | None = None) -> StartUp:
    """Steps 2 and 3 of the module docstring, on every hosted worker. ``named``: the parameters to
    bucket and fingerprint (``model.named_parameters()``, or only the trainable ones);
    ``cap_bytes``: the bucket cap, also the broadcast's message cap; ``options`` and ``agree``: the
    fingerprint's settings (``check=False`` skips the comparison); ``broadcast=False`` keeps each
    rank's own values (every parameter and floating-point buffer of ``model`` otherwise).
    ``on_plan``: the caller's own check of the buckets (DiLoCo: its fragments), run before any
    collective, so that a plan it cannot honour fails alike on every rank without a word sent."""
    # Small tensors ride apart, uncompressed, unless the payload is the gradient itself (none).
    buckets = assign_buckets(list(named), cap_bytes, min_compress_numel, separate_small=not compressor.identity)
    if on_plan is not None:
        on_plan(buckets)
    if check:
        check_agreement(comms, [fingerprint(list(named), compressor.spec, options, agree)] * len(comms))
    if broadcast:
        state = [p for _, p in model.named_parameters()] + [b for b in model.buffers() if b.is_floating_point()]
        broadcast_state(comms, state, cap_bytes, shared=sim)
    # One compressor (one state: error memory, PowerSGD's Q) per worker.
    compressors = [compressor] + [create(compressor.spec) for _ in comms[1:]]
    schemes = [scheme_for(c, m, hierarchical, intra_dtype) for c, m in zip(compressors, comms)]
    for s in schemes:  # after every worker's splits (sim binds them once all have split)
        s.bind()
    return StartUp(sim, list(comms), compressor.spec, buckets, compressors, schemes)
