"""How often workers synchronise: the ``--sync`` spec of ``gradzip train`` and ``gradzip simulate``.

Three modes (spellings are a contract; ``gradzip ls`` lists them):

- ``step`` (default): every optimizer step exchanges the (compressed) gradients, as DDP does.
- ``diloco:every=H,outer_lr=0.7,momentum=0.9,fragments=1,delay=0,alpha=0`` (Douillard et al. 2023,
  Streaming DiLoCo 2025): every worker takes H local (inner) steps, then the workers average the
  pseudo-gradient Δ = θ_global − θ_local, sent through the compressor, and take one outer
  Nesterov-SGD step. ``fragments=P`` syncs the model in P pieces at evenly spaced steps, each
  sent ``delay`` = τ steps before it is applied (τ < H/P); ``alpha`` mixes the local parameters
  into the merged ones (0: take the global ones).
  ``overlap=1`` (DiLoCo, Streaming DiLoCo, LocalSGD and SparseLoCo alike; the delayed outer update
  of Kale, Douillard et al. 2025 and DiLoCoX 2025): each sync's exchange travels during the next H
  inner steps and its outer step is applied one round late (:mod:`gradzip.engine.diloco`).
- ``localsgd:every=H``: parameter averaging every H steps, which is DiLoCo with an outer SGD of
  lr 1 and no momentum.

Modes registered later (:func:`gradzip.engine.modes.register_sync`, e.g. ``sparseloco``) add their
own spellings through :func:`register_spelling`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gradzip.compress.registry import parse_spec
from gradzip.errors import SpecError

MODES = {
    "step": "exchange gradients every step (default)",
    "diloco": "H inner steps, then an outer Nesterov step on the averaged pseudo-gradient "
              "(every=H,outer_lr=0.7,momentum=0.9,fragments=1,delay=0,alpha=0)",
    "localsgd": "average the parameters every H steps (every=H)",
}
_KEYS: dict[str, tuple[str, ...]] = {
    "diloco": ("every", "outer_lr", "momentum", "fragments", "delay", "alpha", "nesterov", "overlap"),
    "localsgd": ("every", "fragments", "delay", "overlap"), "step": ()}
_COMMON = frozenset(_KEYS["diloco"])  # parsed into SyncSpec's fields; a new mode's other keys: options
_DEFAULTS: dict[str, dict[str, str]] = {}  # a registered mode's defaults, as text
_CODECS: dict[str, Callable[[SyncSpec], str]] = {}  # a mode that sends its own codec: spec -> compressor spec


def register_spelling(mode: str, help: str, keys: tuple[str, ...], defaults: dict[str, str] | None = None,
                      codec: Callable[[SyncSpec], str] | None = None) -> None:
    """Accept ``--sync MODE:key=value,...`` with ``keys`` (:func:`gradzip.engine.modes.register_sync`
    calls it). The keys among :class:`SyncSpec`'s fields are parsed into them; any other key is
    kept, as text, in ``SyncSpec.options`` for the mode's builder. ``defaults`` (text, keys among
    ``keys``) fill the keys not given, ``every`` included (``--sync MODE`` alone then parses).
    ``codec``: for a mode that sends every parameter through a codec of its own in place of
    ``--compressor`` (``sparseloco``), the compressor spec of a parsed spec (:func:`mode_codec`).
    The built-in modes are here already."""
    if mode in _KEYS and _KEYS[mode] != tuple(keys):
        raise ValueError(f"--sync {mode} is spelled twice, with different parameters")
    if extra := sorted(set(defaults or {}) - set(keys)):
        raise ValueError(f"--sync {mode}: defaults for keys it does not take: {extra}")
    MODES[mode], _KEYS[mode] = MODES.get(mode, help), tuple(keys)
    _DEFAULTS[mode] = {k: str(v) for k, v in (defaults or {}).items()}
    if codec is not None:
        _CODECS[mode] = codec


def mode_codec(sync: SyncSpec) -> str | None:
    """The compressor spec that ``sync``'s mode sends every parameter through in place of
    ``--compressor`` (registered with its spelling; ``--min-compress-numel`` does not apply to it),
    or None for the modes that send ``--compressor``'s payload. A :class:`SpecError` (one line)
    for settings the mode refuses."""
    codec = _CODECS.get(sync.mode)
    return None if codec is None else codec(sync)


def unregister_spelling(mode: str) -> None:
    """Forget a registered spelling (tests and plugins that unload); the built-in ones stay."""
    if mode not in ("step", "diloco", "localsgd"):
        MODES.pop(mode, None)
        _KEYS.pop(mode, None)
        _DEFAULTS.pop(mode, None)
        _CODECS.pop(mode, None)


def _fmt(v: object) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


@dataclass(frozen=True)
class SyncSpec:
    """A parsed ``--sync`` spec. ``mode == "step"`` ignores every other field."""

    mode: str = "step"
    every: int = 1  # H: inner steps per sync
    outer_lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False
    fragments: int = 1  # P
    delay: int = 0  # τ: inner steps between sending a fragment and applying it
    alpha: float = 0.0  # Streaming DiLoCo's mixing of the local parameters at the merge
    overlap: int = 0  # 1: each exchange travels during the next round, its outer step applied one round late
    options: tuple[tuple[str, str], ...] = ()  # a registered mode's own keys, as given

    @property
    def outer(self) -> bool:
        """True for DiLoCo and LocalSGD (parameters sync every H steps, not gradients every step)."""
        return self.mode != "step"

    def send_step(self, fragment: int) -> int:
        """Inner step (1..H, within each period of H) at which ``fragment`` is sent. Fragment P−1
        (the last) is sent at step H − τ, so that with P = 1 and τ = 0 the model syncs at step H;
        the others are spaced H/P apart before it."""
        h, p = self.every, self.fragments
        return h - self.delay - (p - 1 - fragment) * (h // p)

    def sends_at(self, step: int) -> list[int]:
        """Fragments sent after global step ``step`` (1-based)."""
        if not self.outer:
            return []
        r = (step - 1) % self.every + 1
        return [f for f in range(self.fragments) if self.send_step(f) == r]

    def __str__(self) -> str:
        if self.mode == "step":
            return "step"
        if self.mode not in ("diloco", "localsgd"):  # a registered mode: every=H, its keys among the fields, its own
            # overlap=0, fragments=1 and delay=0 are left out: the spelling of runs before those keys
            unset = {"overlap": 0, "fragments": 1, "delay": 0}
            mine = [k for k in _KEYS.get(self.mode, ()) if k in _COMMON and k != "every"
                    and getattr(self, k) != unset.get(k, object())]
            fields = [f"{k}={_fmt(getattr(self, k))}" for k in mine]
            return ",".join([f"{self.mode}:every={self.every}", *fields, *(f"{k}={v}" for k, v in self.options)])
        if self.mode == "localsgd":
            extra = f",fragments={self.fragments},delay={self.delay}" if self.fragments > 1 or self.delay else ""
            return f"localsgd:every={self.every}{extra}" + (f",overlap={self.overlap}" if self.overlap else "")
        s = f"diloco:every={self.every},outer_lr={self.outer_lr:g},momentum={self.momentum:g}"
        s += f",fragments={self.fragments},delay={self.delay}"
        if self.alpha:
            s += f",alpha={self.alpha:g}"
        if not self.nesterov and self.momentum:
            s += ",nesterov=false"
        return s + (f",overlap={self.overlap}" if self.overlap else "")


def parse_sync(text: str | SyncSpec | None) -> SyncSpec:
    """Parse a ``--sync`` spec; raise :class:`SpecError` (one line, with the fix) on any mistake."""
    if isinstance(text, SyncSpec):
        return text
    raw = (text or "step").strip()
    try:
        mode, params = parse_spec(raw)
    except SpecError as e:
        raise SpecError(str(e).replace("compressor spec", "--sync spec")) from None
    if mode not in MODES:
        raise SpecError(f"unknown --sync mode {mode!r} in {raw!r}; choose one of: {', '.join(MODES)} "
                        "(e.g. diloco:every=16)")
    if "overlap" in params and "overlap" not in _KEYS[mode]:
        raise SpecError(f"--sync {mode} has no outer step to overlap (in {raw!r}); overlap=1 takes an outer mode, "
                        "e.g. diloco:every=16,overlap=1")
    for k in params:
        if k not in _KEYS[mode]:
            allowed = ", ".join(_KEYS[mode]) or "none"
            raise SpecError(f"--sync {mode} has no parameter {k!r} (in {raw!r}); its parameters: {allowed}")
    if mode == "step":
        return SyncSpec()
    params = {**_DEFAULTS.get(mode, {}), **params}

    def num(key: str, kind: type, default: float) -> float:
        v = params.get(key)
        if v is None:
            return default
        try:
            return kind(v)
        except ValueError:
            raise SpecError(f"--sync {mode}: {key}={v!r} is not {'an integer' if kind is int else 'a number'} "
                            f"(in {raw!r})") from None

    if "every" not in params:
        raise SpecError(f"--sync {mode} needs every=H, the inner steps between syncs (e.g. {mode}:every=16)")
    every, fragments, delay = int(num("every", int, 1)), int(num("fragments", int, 1)), int(num("delay", int, 0))
    overlap = int(num("overlap", int, 0))
    diloco = mode == "diloco"
    outer_lr = num("outer_lr", float, 0.7 if diloco else 1.0)
    momentum = num("momentum", float, 0.9 if diloco else 0.0)
    alpha = num("alpha", float, 0.0)
    nesterov = params.get("nesterov", "true").lower() in ("1", "true", "yes", "on")
    if params.get("nesterov", "true").lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise SpecError(f"--sync {mode}: nesterov={params['nesterov']!r} is not true or false")
    if every < 1:
        raise SpecError(f"--sync {mode}: every={every} must be >= 1 (inner steps per sync)")
    if fragments < 1:
        raise SpecError(f"--sync {mode}: fragments={fragments} must be >= 1")
    if every % fragments:
        raise SpecError(f"--sync {mode}: fragments={fragments} does not divide every={every}; pick P with H % P == 0")
    if delay < 0 or delay >= every // fragments:
        raise SpecError(f"--sync {mode}: delay={delay} must be in [0, H/P) = [0, {every // fragments}): a fragment "
                        "must be applied before it is sent again")
    if overlap not in (0, 1):
        raise SpecError(f"--sync {mode}: overlap={overlap} must be 0 or 1 (rounds an exchange overlaps)")
    if overlap and delay:
        raise SpecError(f"--sync {mode}: overlap=1 already delays each outer step by a whole round; "
                        f"give delay=0 with it (not delay={delay})")
    if not (math.isfinite(outer_lr) and outer_lr > 0):
        raise SpecError(f"--sync {mode}: outer_lr={outer_lr} must be a positive number")
    if not (math.isfinite(momentum) and 0 <= momentum < 1):
        raise SpecError(f"--sync {mode}: momentum={momentum} must be in [0, 1)")
    if not (math.isfinite(alpha) and 0 <= alpha <= 1):
        raise SpecError(f"--sync {mode}: alpha={alpha} must be in [0, 1]")
    options = tuple(sorted((k, v) for k, v in params.items() if k not in _COMMON))
    return SyncSpec(mode=mode, every=every, outer_lr=outer_lr, momentum=momentum, nesterov=nesterov and momentum > 0,
                    fragments=fragments, delay=delay, alpha=alpha, overlap=overlap, options=options)
