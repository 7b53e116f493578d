"""``--sync sparseloco``: SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706; Templar's Covenant-72B).

Every H inner steps, on each replica, with Δ = θ_global − θ_local its pseudo-gradient:

1. e ← β·e + Δ (the error memory: one copy of the parameters per rank, in checkpoints; fp32, or
   bf16 with ``ef_dtype=bf16``, half the bytes, the arithmetic still fp32);
2. ĉ = Q(TopK per chunk(e)): the ``sparseloco`` codec (:mod:`gradzip.compress.sparseloco`),
   allgathered at a fixed size;
3. e ← e − decode(ĉ);
4. θ_global ← θ_global − α·aggregate(ĉ over replicas), a plain SGD step with no momentum, and every
   replica restarts from θ_global. The aggregate is each coordinate's mean over the replicas that
   selected it (``aggregate=mean``: over all replicas).

It is :class:`~gradzip.engine.diloco.DiLoCo` with an outer ``torch.optim.SGD(lr=α, momentum=0)``
and the compressor ``sparseloco:chunk=..,k=..,bits=..,range=..,index=..,aggregate=..,ef=true,ef_decay=β``
(error feedback with decay: steps 1-3), so it runs on sim, gloo and mpi, resumes, and counts its
bytes like every DiLoCo sync. Every parameter travels in the codec, small ones included
(``--min-compress-numel`` does not apply). Defaults: the published 70B configuration (H = 30, chunk 64, k = 64,
2 bits, range 6, β = 0.95, α = 1). The codec replaces ``--compressor``, and the outer step
replaces DiLoCo's ``outer_lr``/``momentum`` (``gradzip train`` refuses them with it).
``ef_dtype=bf16`` keeps the error memory in bf16 (:func:`memory_dtype`); it is not a default, so
``--sync sparseloco`` spells as before.
"""

from __future__ import annotations

from typing import Any

import torch

from gradzip.compress.ef import ErrorFeedback
from gradzip.engine.modes import SyncSettings, _engine_kwargs, register_sync
from gradzip.engine.synchronizer import Synchronizer
from gradzip.errors import GradzipError, SpecError
from gradzip.plan.sync import SyncSpec

CODEC_KEYS = ("chunk", "k", "bits", "range", "index", "aggregate")  # passed to the codec as given
EF_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # ``ef_dtype=``: the error memory's dtype


def memory_dtype(sync: SyncSpec) -> torch.dtype:
    """The error memory's dtype of a parsed ``--sync sparseloco``: ``ef_dtype=fp32`` (the default)
    or ``bf16`` (half the memory; e ← β·e + Δ and the subtraction still run in fp32, the new
    residual is rounded into bf16: :class:`gradzip.compress.ef.ErrorFeedback`'s ``memory_dtype``)."""
    name = dict(sync.options).get("ef_dtype", "fp32")
    if name not in EF_DTYPES:
        raise SpecError(f"--sync sparseloco: ef_dtype={name!r} must be fp32 or bf16 (the error memory's dtype; "
                        "bf16 halves it)")
    return EF_DTYPES[name]


def codec_spec(sync: SyncSpec) -> str:
    """The compressor spec a parsed ``--sync sparseloco`` (or ``ftsparseloco``) sends its pseudo-gradient
    through; a :class:`SpecError` (one line) for a β outside [0, 1], an α of 0 or an ``ef_dtype`` other
    than fp32 and bf16 (the memory's dtype is no part of the spec: :func:`keep_memory_in`)."""
    memory_dtype(sync)
    if not sync.alpha > 0:
        raise SpecError(f"--sync {sync.mode}: alpha=0 would never move the parameters; give alpha in (0, 1], e.g. 1")
    opts = dict(sync.options)
    try:
        beta = float(opts["beta"])
    except ValueError:
        raise SpecError(f"--sync {sync.mode}: beta={opts['beta']!r} is not a number") from None
    if not 0.0 <= beta <= 1.0:
        raise SpecError(f"--sync {sync.mode}: beta={beta:g} must be in [0, 1] (the error memory's decay)")
    codec = ",".join(f"{k}={opts[k]}" for k in CODEC_KEYS)
    return f"sparseloco:{codec},ef=true,ef_decay={beta:g}"


def keep_memory_in(compressors: Any, dtype: torch.dtype) -> None:
    """Keep the error memory of every one of ``compressors`` (SparseLoCo's error feedback, built from
    :func:`codec_spec`, before its first step) in ``dtype``; fp32 leaves them exactly as built."""
    for comp in compressors:
        if not isinstance(comp, ErrorFeedback) or comp.memory:
            raise GradzipError("SparseLoCo's error memory dtype is set on its error feedback before the first sync")
        comp.memory_dtype = dtype


def _build(model: torch.nn.Module, optimizer: torch.optim.Optimizer, target: Any, s: SyncSettings) -> Synchronizer:
    from gradzip.engine.diloco import DiLoCo

    params = [p for p in model.parameters() if p.requires_grad]
    outer = torch.optim.SGD(params, lr=s.sync.alpha, momentum=0.0)  # θ ← θ − α·aggregate
    engine = {**_engine_kwargs(s), "min_compress_numel": 0}  # every parameter in the codec, as published
    sync = DiLoCo(model, optimizer, outer, target, s.sync.every, codec_spec(s.sync), **engine,
                  outer_overlap=s.sync.overlap, hook=False)
    keep_memory_in(sync.compressors, memory_dtype(s.sync))
    return sync


DEFAULTS = {"every": "30", "beta": "0.95", "alpha": "1", "chunk": "64", "k": "64", "bits": "2", "range": "6",
            "index": "pack12", "aggregate": "selected"}  # the published 70B configuration
register_sync("sparseloco", "SparseLoCo: every H steps, error feedback with decay β, top-k per chunk with 2-bit "
              "codes, outer SGD step α (every=30,beta=0.95,alpha=1,chunk=64,k=64,bits=2,range=6,index=pack12; "
              "ef_dtype=bf16 halves the error memory)", _build,
              keys=("every", "beta", "alpha", "overlap", *CODEC_KEYS, "ef_dtype"), defaults=DEFAULTS, codec=codec_spec)
