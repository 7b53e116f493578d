"""``--sync sparseloco``: SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706; Templar's Covenant-72B).

Every H inner steps, on each replica, with Δ = θ_global − θ_local its pseudo-gradient:

1. e ← β·e + Δ (the error memory: one fp32 copy of the parameters per rank, in checkpoints);
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
"""

from __future__ import annotations

from typing import Any

import torch

from gradzip.engine.modes import SyncSettings, _engine_kwargs, register_sync
from gradzip.engine.synchronizer import Synchronizer
from gradzip.errors import SpecError
from gradzip.plan.sync import SyncSpec

CODEC_KEYS = ("chunk", "k", "bits", "range", "index", "aggregate")  # passed to the codec as given


def codec_spec(sync: SyncSpec) -> str:
    """The compressor spec a parsed ``--sync sparseloco`` (or ``ftsparseloco``) sends its pseudo-gradient through; a
    :class:`SpecError` (one line) for a β outside [0, 1] or an α of 0."""
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


def _build(model: torch.nn.Module, optimizer: torch.optim.Optimizer, target: Any, s: SyncSettings) -> Synchronizer:
    from gradzip.engine.diloco import DiLoCo

    params = [p for p in model.parameters() if p.requires_grad]
    outer = torch.optim.SGD(params, lr=s.sync.alpha, momentum=0.0)  # θ ← θ − α·aggregate
    engine = {**_engine_kwargs(s), "min_compress_numel": 0}  # every parameter in the codec, as published
    return DiLoCo(model, optimizer, outer, target, s.sync.every, codec_spec(s.sync), **engine,
                  outer_overlap=s.sync.overlap, hook=False)


DEFAULTS = {"every": "30", "beta": "0.95", "alpha": "1", "chunk": "64", "k": "64", "bits": "2", "range": "6",
            "index": "pack12", "aggregate": "selected"}  # the published 70B configuration
register_sync("sparseloco", "SparseLoCo: every H steps, error feedback with decay β, top-k per chunk with 2-bit "
              "codes, outer SGD step α (every=30,beta=0.95,alpha=1,chunk=64,k=64,bits=2,range=6,index=pack12)", _build,
              keys=("every", "beta", "alpha", "overlap", *CODEC_KEYS), defaults=DEFAULTS, codec=codec_spec)
