"""Streaming DiLoCo's fragments for the fault-tolerant modes (``--sync ftdiloco:...,fragments=P``).

The model's parameters (in the model's order) are split into P contiguous fragments of about
equal elements (:func:`gradzip.plan.buckets.split_fragments`, as the non-fault-tolerant engine
splits its buckets). Fragment f is synchronised at inner step (f + 1)·H/P of every period of H
steps: each sync is a torchft quorum of its own, with its own commit, so a heal, a lost group or a
refused quorum concerns one fragment's sync. The delay τ is 0: a fragment is applied at the step
it is sent (docs/fault-tolerance.md says why). P = 1 is plain DiLoCo: one fragment, the whole
model, synchronised every H steps.

:class:`FragmentPlan` is the split and the schedule; :class:`FragmentExchange` is one fragment's
exchange (header and payload allgather), weighted mean and outer step, mixed into
:class:`~gradzip.engine.ftdiloco.FTDiLoCo`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gradzip.engine import _ft
from gradzip.errors import GradzipError
from gradzip.plan.buckets import split_fragments

KEY = "ft"  # the compressor's state key: the whole model (fragment f: ft/f)
Results = list[tuple[list[float], tuple[Tensor, ...]]]  # (header, payload) per quorum member, in rank order


@dataclass(frozen=True)
class FragmentPlan:
    """Which parameters each fragment holds (``parts``: indices into the trainable parameters) and
    when each one syncs, for H = ``every`` inner steps per period."""

    every: int
    parts: tuple[tuple[int, ...], ...]

    @classmethod
    def split(cls, numels: list[int], every: int, fragments: int, mode: str = "ftdiloco") -> FragmentPlan:
        """P = ``fragments`` contiguous fragments of the parameters of sizes ``numels``; a
        :class:`GradzipError` (one line) when P does not divide H or exceeds the parameter count."""
        if fragments < 1 or every % fragments:
            raise GradzipError(f"--sync {mode}: fragments={fragments} must be >= 1 and divide every={every}")
        if fragments > len(numels):
            raise GradzipError(f"--sync {mode}: fragments={fragments} but the model has only {len(numels)} "
                               "trainable parameter tensors (a fragment holds whole tensors); lower fragments")
        return cls(every, tuple(tuple(p) for p in split_fragments(numels, fragments)))

    @property
    def count(self) -> int:
        """P, the number of fragments."""
        return len(self.parts)

    @property
    def span(self) -> int:
        """H/P: inner steps between two fragments' syncs."""
        return self.every // self.count

    def due(self, step: int) -> bool:
        """Whether inner step ``step`` (1-based) ends with a sync."""
        return step > 0 and step % self.span == 0

    def at(self, step: int) -> int | None:
        """The fragment a sync at inner step ``step`` carries: with P = 1 always the whole model
        (a join sync included, as plain DiLoCo has it); with P > 1 the fragment due at ``step``,
        or None for a join sync between two fragments' steps (it forms the quorum and heals, and
        carries no update: every group's pending pseudo-gradients wait for their own step)."""
        if self.count == 1:
            return 0
        if not self.due(step):
            return None
        return ((step - 1) % self.every) // self.span

    def key(self, base: str, fragment: int) -> str:
        """The compressor's state key of ``fragment``: ``base`` for the whole model, ``base/f`` for a
        fragment (so that forgetting ``base`` drops every fragment's error memory)."""
        return base if self.count == 1 else f"{base}/{fragment}"


class FragmentExchange:
    """One fragment's exchange and outer step, for :class:`gradzip.engine.ftdiloco.FTDiLoCo` (which
    holds the state named below): the header and payload allgather, the decode, the weighted mean
    and the outer step on the fragment's parameters. :class:`gradzip.engine.ftsparseloco.FTSparseLoCo`
    overrides the encode, the decode and the mean."""

    if TYPE_CHECKING:  # the replica group's state (FTDiLoCo)
        comp: Any
        ft: _ft.Group
        outer: torch.optim.Optimizer
        params: list[torch.nn.Parameter]
        global_: list[Tensor]
        plan: FragmentPlan
        weights: list[float]
        group: int
        rank: int
        size: int
        _healed: bool

        def _share_update(self, frag: int, avg: Tensor | None) -> Tensor | None: ...

    def _exchange(self, frag: int | None, world: int) -> tuple[Results, Any]:
        """Fragment ``frag``'s pseudo-gradient compressed and allgathered with its header (weight,
        healed, group, fragment); ``frag=None`` (a join sync between two fragments' steps) sends
        nothing. Raises when the members do not sync the same fragment (the Manager then does not
        commit)."""
        weight = 0.0 if self._healed or frag is None else self.weights[frag]
        payload: tuple[Tensor, ...] = ()
        ctx: Any = None
        if frag is not None:
            payload, ctx = self._encode(frag, self.plan.key(KEY, frag))
        if weight == 0:  # nothing to contribute: send nothing, and leave the error memory as it was
            self.comp.end_step(False)
            self.comp.begin_step()
            payload = ()
        weight *= self.size  # the group's tokens: each of its ranks trained on as many
        header = [weight, float(self._healed), float(self.group), -1.0 if frag is None else float(frag)]
        results = _ft.allgather_payloads(self.ft.pg, payload, header, world)
        if any(h[3] != header[3] for h, _ in results):
            raise GradzipError(f"the quorum's groups sync different fragments ({[int(h[3]) for h, _ in results]}, "
                               f"-1: none): their steps disagree")
        return results, ctx

    def _delta(self, frag: int) -> Tensor:
        """θ_global − θ_local over fragment ``frag``'s parameters, one flat fp32 tensor."""
        return torch.cat([(self.global_[i].float() - self.params[i].detach().float()).reshape(-1)
                          for i in self.plan.parts[frag]])

    def _encode(self, frag: int, key: str) -> tuple[tuple[Tensor, ...], Any]:
        """Fragment ``frag``'s pseudo-gradient through the compressor, flat, under state ``key``."""
        return self.comp.compress(self._delta(frag), key)

    def _decode(self, payload: tuple[Tensor, ...], ctx: Any) -> Tensor:
        """One participant's payload, decoded to a flat fp32 tensor."""
        return self.comp.decompress(payload, ctx).reshape(-1).float()

    def _average(self, results: Results, ctx: Any) -> Tensor | None:
        """Σ wᵢ·Δᵢ / Σ wᵢ over the participants (weight > 0), in quorum rank order (the same sum on
        every group); None when every weight is 0."""
        total = sum(h[0] for h, _ in results)
        if total <= 0:
            return None
        avg: Tensor | None = None
        for h, payload in results:
            if h[0] == 0:
                continue
            d = self._decode(payload, ctx) * (h[0] / total)
            avg = d if avg is None else avg.add_(d)
        return avg

    def _apply(self, frag: int, results: Results, ctx: Any) -> None:
        """The committed sync of fragment ``frag``: the outer step on its averaged Δ (skipped when
        every weight is 0), then θ_local ← θ_global on its parameters; its weight starts again."""
        avg = self._average(results, ctx) if self.rank == 0 else None
        if self.size > 1:  # rank 0 exchanged for the group: its update, to every rank
            avg = self._share_update(frag, avg)
        if avg is not None:
            self._outer_step(frag, avg)
        for i in self.plan.parts[frag]:
            self.params[i].copy_(self.global_[i])
        self.weights[frag] = 0.0

    def _outer_step(self, frag: int, avg: Tensor) -> None:
        """``outer.step()`` on fragment ``frag``'s θ_global (swapped into its parameters) with ``avg``
        as the gradient; the other parameters have none, so the optimizer leaves them (and their
        state) alone."""
        saved = [(p.data, p.grad) for p in self.params]
        for p in self.params:
            p.grad = None
        off = 0
        for i in self.plan.parts[frag]:
            p, g = self.params[i], self.global_[i]
            p.data = g
            p.grad = avg[off:off + g.numel()].view(g.shape).to(g.dtype)
            off += g.numel()
        try:
            self.outer.step()
        finally:
            for p, (data, grad) in zip(self.params, saved):
                p.data, p.grad = data, grad
