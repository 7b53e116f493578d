"""Streaming DiLoCo's fragments for the fault-tolerant modes (``--sync ftdiloco:...,fragments=P``).

The model's parameters (in the model's order) are split into P contiguous fragments of about
equal elements (:func:`gradzip.plan.buckets.split_fragments`, as the non-fault-tolerant engine
splits its buckets). Fragment f is synchronised at inner step (f + 1)·H/P of every period of H
steps: each sync is a torchft quorum of its own, with its own commit, so a heal, a lost group or a
refused quorum concerns one fragment's sync. The delay τ is 0: a fragment is applied at the step
it is sent (docs/fault-tolerance.md says why). P = 1 is plain DiLoCo: one fragment, the whole
model, synchronised every H steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradzip.errors import GradzipError
from gradzip.plan.buckets import split_fragments


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
