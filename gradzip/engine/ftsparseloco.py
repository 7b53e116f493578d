"""``--sync ftsparseloco``: SparseLoCo that survives its replicas, on torchft (``pip install "gradzip[ft]"``).

SparseLoCo's outer step (:mod:`gradzip.engine.sparseloco`) on the fault-tolerant sync of
:class:`~gradzip.engine.ftdiloco.FTDiLoCo` (one ``gradzip train`` run per replica group, a
Lighthouse, quorum, healing, the fresh-state guard, the digest, ``ft.jsonl``). Every H inner
steps, in each group of the quorum:

1. e ← β·e + Δ, ĉ = Q(TopK per chunk(e)), e ← e − decode(ĉ): the ``sparseloco`` codec per
   parameter tensor, with its error memory decayed by β (``ef=true,ef_decay=β``); the memory is
   this group's own, reset when the group heals (as DiLoCo's error feedback is);
2. the payloads are allgathered with their weights (tokens since the group's last committed sync);
3. the aggregate, the same floats on every group (quorum rank order): with ``aggregate=selected``,
   each coordinate's weighted mean over the participants that selected it,
   Σᵢ wᵢ·ĉᵢ[j] / Σᵢ wᵢ·[ĉᵢ[j] ≠ 0] (0 where no one did); with equal weights it is the codec's own
   mean over the selecting replicas. ``aggregate=mean``: Σᵢ wᵢ·ĉᵢ / Σᵢ wᵢ, as ``ftdiloco``;
4. θ_global ← θ_global − α·aggregate (SGD, no momentum: the outer state a heal copies is empty),
   θ_local ← θ_global; committed or not as the Manager decides.

Keys: SparseLoCo's (``every=30,beta=0.95,alpha=1,chunk=64,k=64,bits=2,range=6,index=pack12,
aggregate=selected``) and the fault-tolerant ones (``groups``, ``group``, ``min_replicas``,
``lighthouse``, ``lighthouse_port``). The codec replaces ``--compressor``, as with ``sparseloco``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradzip.engine.ftdiloco import FT_DEFAULTS, FT_KEYS, FTDiLoCo, check_reachable, group_kwargs
from gradzip.engine.modes import SyncSettings, register_sync
from gradzip.engine.sparseloco import CODEC_KEYS, DEFAULTS, codec_spec
from gradzip.engine.synchronizer import Synchronizer


class FTSparseLoCo(FTDiLoCo):
    """Fault-tolerant SparseLoCo for one replica group (module docstring). ``codec``: the
    ``sparseloco`` compressor spec with ``ef=true,ef_decay=β``
    (:func:`gradzip.engine.sparseloco.codec_spec`); ``outer``: ``SGD(lr=α, momentum=0)``;
    ``aggregate``: ``selected`` or ``mean`` (the codec's own setting); the other keywords are
    :class:`FTDiLoCo`'s."""

    mode = "ftsparseloco"

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, outer: torch.optim.Optimizer,
                 every: int, codec: str, *, aggregate: str = "selected", **kwargs: Any) -> None:
        super().__init__(model, inner, outer, every, codec, **kwargs)
        self.aggregate = aggregate

    def _encode(self, frag: int, key: str) -> tuple[tuple[Tensor, ...], Any]:
        """The pseudo-gradient per parameter tensor (the codec chunks each tensor in its own shape)."""
        deltas = [self.global_[i].float() - self.params[i].detach().float() for i in self.plan.parts[frag]]
        return self.comp.compress_batch(deltas, key)

    def _decode(self, payload: tuple[Tensor, ...], ctx: Any) -> Tensor:
        return torch.cat([t.reshape(-1).float() for t in self.comp.decompress_batch(payload, ctx)])

    def _average(self, results: list[tuple[list[float], tuple[Tensor, ...]]], ctx: Any) -> Tensor | None:
        """``aggregate=selected``: Σ wᵢ·ĉᵢ / Σ wᵢ·[ĉᵢ ≠ 0] per coordinate over the participants,
        with wᵢ normalised by Σ wᵢ, in quorum rank order; None when every weight is 0."""
        if self.aggregate == "mean":
            return super()._average(results, ctx)
        total = sum(h[0] for h, _ in results)
        if total <= 0:
            return None
        num: Tensor | None = None
        den: Tensor | None = None
        for h, payload in results:
            if h[0] == 0:
                continue
            w = h[0] / total
            d = self._decode(payload, ctx)
            sel = (d != 0).float().mul_(w)
            num, den = (d.mul(w), sel) if num is None or den is None else (num.add_(d.mul(w)), den.add_(sel))
        assert num is not None and den is not None
        return num.div_(den.masked_fill_(den == 0, 1.0))


def _build(model: torch.nn.Module, optimizer: torch.optim.Optimizer, target: Any, s: SyncSettings) -> Synchronizer:
    """One replica group per ``gradzip train`` process; the outer step θ ← θ − α·aggregate."""
    kwargs = group_kwargs(target, s)
    params = [p for p in model.parameters() if p.requires_grad]
    outer = torch.optim.SGD(params, lr=s.sync.alpha, momentum=0.0)
    return FTSparseLoCo(model, optimizer, outer, s.sync.every, codec_spec(s.sync),
                        aggregate=dict(s.sync.options)["aggregate"], **kwargs)


register_sync("ftsparseloco", "fault-tolerant SparseLoCo on torchft, one replica group per run (sparseloco's keys, "
              "and groups=N,group=I,min_replicas=1,lighthouse=local|http://HOST:PORT)", _build,
              keys=("every", "beta", "alpha", *CODEC_KEYS, *FT_KEYS), defaults={**DEFAULTS, **FT_DEFAULTS},
              codec=codec_spec, machine_check=check_reachable)
