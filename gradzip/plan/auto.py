"""``auto``: the spelling of the adaptive compression policy's options (the policy: :mod:`gradzip.cluster.auto`).

Grammar (one compressor spec, so it goes wherever a spec goes: ``--compressor``, sweeps)::

    auto
    auto:candidates=none/fp16/powersgd:rank=4/topk:ratio=0.01+ef=true,floor=powersgd:rank=4,tolerance=0.1

- ``candidates``: the compressors the policy may choose per bucket, separated by ``/``, in the
  user's **quality order** (least aggressive first). Inside a candidate, ``+`` separates its own
  options, since ``,`` separates auto's (``topk:ratio=0.01+ef=true`` is ``topk:ratio=0.01,ef=true``).
  Default: :data:`DEFAULT_CANDIDATES`.
- ``floor``: the most aggressive candidate allowed (one of the candidates, same spelling); the ones
  after it in the quality order are dropped. Default: none dropped.
- ``replan_every``: re-probe and re-plan every N steps (0: only when the prediction drifts); default 200.
- ``tolerance``: the relative gap between measured and predicted communication time that counts
  as a drift (default 0.1); ``patience``: steps in a row of drift before a re-plan (default 3).
- ``warmup``: uncompressed steps before the first plan, as torch's PowerSGD hook starts (default 0).

Every candidate is checked by the compressor registry when the spec is parsed; a candidate on the
``twophase`` exchange (whose server memory cannot follow a bucket to another compressor) and a
floor that is not a candidate are refused: one line naming the fix, before any collective, for
``gradzip train`` and ``gradzip simulate`` alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradzip.compress.registry import create, normalize_spec, parse_spec
from gradzip.errors import SpecError

# Least aggressive first: the policy only moves down this list when the link makes it pay.
DEFAULT_CANDIDATES = ("none", "fp16", "powersgd:rank=4", "topk:ratio=0.01,ef=true", "onebit")
KEYS = ("candidates", "floor", "replan_every", "tolerance", "patience", "warmup")
# Why a twophase candidate cannot be planned per bucket (the wording of gradzip.engine.choice).
TWOPHASE_REFUSAL = ("twophase keeps server memory per rank, which cannot follow a bucket to another compressor; "
                    "use its own collective (drop exchange=twophase)")


@dataclass(frozen=True)
class AutoSpec:
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    floor: str | None = None
    replan_every: int = 200
    tolerance: float = 0.1
    patience: int = 3
    warmup: int = 0

    @property
    def allowed(self) -> tuple[str, ...]:
        """The candidates up to and including the floor, in quality order."""
        if self.floor is None:
            return self.candidates
        return self.candidates[: self.candidates.index(self.floor) + 1]

    @property
    def spec(self) -> str:
        """The canonical spelling (what configs, labels and run names echo)."""
        parts = ["candidates=" + "/".join(c.replace(",", "+") for c in self.candidates)]
        if self.floor is not None:
            parts.append("floor=" + self.floor.replace(",", "+"))
        defaults = AutoSpec()
        for k in ("replan_every", "tolerance", "patience", "warmup"):
            if getattr(self, k) != getattr(defaults, k):
                parts.append(f"{k}={getattr(self, k):g}")
        return "auto:" + ",".join(parts)


def is_auto(spec: object) -> bool:
    return isinstance(spec, str) and spec.strip().lower().split(":", 1)[0] == "auto"


def _candidate(text: str, spec: str) -> str:
    c = text.strip().replace("+", ",")
    if is_auto(c):
        raise SpecError(f"auto: a candidate cannot be auto itself ({spec!r})")
    try:
        comp = create(c)
    except SpecError as e:
        raise SpecError(f"auto: candidate {text!r} in {spec!r}: {e}") from None
    if comp.exchange == "twophase":  # the engine's ChoiceEngine refuses it too; here before anything runs
        raise SpecError(f"auto: candidate {text!r} in {spec!r}: {TWOPHASE_REFUSAL}")
    return normalize_spec(c)


def parse_auto(spec: str) -> AutoSpec:
    """``auto[:options]`` parsed and checked (module docstring); one-line :class:`SpecError` otherwise."""
    name, params = parse_spec(spec)
    if name != "auto":
        raise SpecError(f"not an auto spec: {spec!r}")
    unknown = sorted(set(params) - set(KEYS))
    if unknown:
        raise SpecError(f"auto: unknown option {unknown[0]!r} in {spec!r}; options: {', '.join(KEYS)}")
    raw = params.get("candidates")
    if raw is not None and not raw.strip("/ "):
        raise SpecError(f"auto: candidates is empty in {spec!r}; list them separated by '/', e.g. none/fp16/onebit")
    cands = tuple(_candidate(c, spec) for c in raw.split("/") if c.strip()) if raw else DEFAULT_CANDIDATES
    if len(set(cands)) != len(cands):
        raise SpecError(f"auto: a candidate is listed twice in {spec!r}")
    floor = None
    if "floor" in params:
        floor = _candidate(params["floor"], spec)
        if floor not in cands:
            raise SpecError(f"auto: floor {floor!r} is not one of the candidates ({' / '.join(cands)}); name one of "
                            "them, spelled the same way")
    try:
        out = AutoSpec(cands, floor, int(params.get("replan_every", 200)), float(params.get("tolerance", 0.1)),
                       int(params.get("patience", 3)), int(params.get("warmup", 0)))
    except ValueError as e:
        raise SpecError(f"auto: {e} in {spec!r}") from None
    if out.replan_every < 0 or out.patience < 1 or out.warmup < 0 or not (
            math.isfinite(out.tolerance) and out.tolerance > 0):
        raise SpecError(f"auto: replan_every and warmup must be >= 0, patience >= 1 and tolerance > 0 in {spec!r}")
    return out
