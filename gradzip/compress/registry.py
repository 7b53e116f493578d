"""Registry of compressors by name, and the spec parser.

A spec is ``NAME`` or ``NAME:key=value,key=value``, e.g. ``"topk:ratio=0.01,ef=true"`` or
``"powersgd:rank=4,warm_start=true"``. Two keys are common to all compressors: ``ef`` wraps the
compressor in :class:`gradzip.compress.ef.ErrorFeedback` (default: the class's ``default_ef``;
``ef=ef21`` in :class:`gradzip.compress.ef21.EF21` instead, for biased compressors; a compressor
that is its own error feedback, ``own_ef`` such as ``demo``, ignores both with a warning);
``ef_decay=β`` (with ``ef=true``) scales the memory by β before each step's gradient is added; and
``exchange`` picks how payloads are combined, one of the class's ``schemes`` (default: its
``collective``), e.g. ``"onebit:exchange=twophase"``.

Adding a compressor is one file in ``gradzip/compress/`` with::

    @register("mycomp")
    class MyComp(Compressor):
        ...

Every module in the package is imported on first use of the registry, so no list needs editing.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import types
import typing
import warnings
from pathlib import Path
from typing import Any

from gradzip.compress.base import SCHEMES, Compressor
from gradzip.compress.ef import ErrorFeedback
from gradzip.compress.ef21 import EF21
from gradzip.errors import SpecError

_REGISTRY: dict[str, type[Compressor]] = {}
_LOADED = False
_WARNED: set[tuple[str, str]] = set()


def register(name: str):
    """Class decorator: register a :class:`Compressor` subclass under ``name``."""

    def deco(cls: type[Compressor]) -> type[Compressor]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"compressor {name!r} registered twice ({_REGISTRY[name]} and {cls})")
        if cls.collective not in ("allreduce", "allgather"):
            raise ValueError(f"{cls.__name__}.collective must be 'allreduce' or 'allgather'")
        if set(cls.schemes) - set(SCHEMES):
            raise ValueError(f"{cls.__name__}.schemes {cls.schemes}: unknown scheme(s); known: {tuple(SCHEMES)}")
        if cls.collective not in cls.schemes:
            raise ValueError(f"{cls.__name__}.schemes {cls.schemes} must include its collective {cls.collective!r}")
        if not dataclasses.is_dataclass(cls.Config):
            raise ValueError(f"{cls.__name__}.Config must be a dataclass")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def unregister(name: str) -> None:
    """Remove the compressor registered under ``name`` (a plug-in's, e.g. at the end of a test)."""
    if name not in _REGISTRY:
        raise ValueError(f"compressor {name!r} is not registered")
    del _REGISTRY[name]


def _load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    # Every public module of the package is imported; the @register decorator, not a list, decides
    # what is a compressor (helpers such as bitpack or select simply register nothing).
    for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):  # this package's folder: no import cycle
        if not mod.name.startswith("_"):
            importlib.import_module(f"gradzip.compress.{mod.name}")
    _LOADED = True


def registry() -> dict[str, type[Compressor]]:
    """Name -> class of every registered compressor, sorted by name."""
    _load_all()
    return dict(sorted(_REGISTRY.items()))


def _convert(raw: str, typ: Any, name: str, key: str) -> Any:
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):  # Optional[int] and friends
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if raw.lower() in ("none", "null", ""):
            return None
        typ = args[0]
    if typ is bool:
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise SpecError(f"{name}: {key}={raw!r} is not a boolean (use true or false)")
    try:
        return typ(raw)
    except (TypeError, ValueError):
        raise SpecError(f"{name}: {key}={raw!r} is not a valid {getattr(typ, '__name__', typ)}") from None


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``"name:k=v,k2=v2"`` into ``("name", {"k": "v", "k2": "v2"})``."""
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    name = name.strip().lower()
    params: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise SpecError(f"bad parameter {item!r} in compressor spec {spec!r}: expected key=value")
        k = k.strip().lower().replace("-", "_")
        if any(c.isspace() for c in k + v.strip()):
            fixed = ",".join(",".join(p.split()) for p in rest.split(",") if p.strip())
            raise SpecError(f"compressor spec {spec!r} has a space inside {item!r}: separate parameters with "
                            f"commas, e.g. {name.strip().lower()}:{fixed}")
        if k in params:
            raise SpecError(f"parameter {k!r} given twice in compressor spec {spec!r}")
        params[k] = v.strip()
    return name, params


def normalize_spec(spec: str) -> str:
    """``spec`` with its name and keys in their registered spelling (``topK:Ratio=0.01`` →
    ``topk:ratio=0.01``); the values stay as written. What configs, labels and run names echo."""
    name, params = parse_spec(spec)
    return name + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")


def create(spec: str | Compressor) -> Compressor:
    """Build a compressor from a spec string (or return it unchanged if already built).

    Raises :class:`SpecError` naming the valid choices for unknown names, unknown parameters
    and out-of-range values.
    """
    if isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(f"empty compressor spec; choose one of: {', '.join(registry())}")
    name, params = parse_spec(spec)
    reg = registry()
    if name not in reg:
        raise SpecError(f"unknown compressor {name!r}; choose one of: {', '.join(reg)}")
    cls = reg[name]
    ef_raw = params.pop("ef", None)
    ef21 = ef_raw is not None and ef_raw.lower() == "ef21"
    if ef_raw is not None and not ef21 and ef_raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise SpecError(f"{name}: ef={ef_raw!r} is not one of true, false or ef21")
    ef = cls.default_ef if ef_raw is None else (False if ef21 else _convert(ef_raw, bool, name, "ef"))
    decay_raw = params.pop("ef_decay", None)
    if decay_raw is not None and (ef21 or not ef):
        raise SpecError(f"{name}: ef_decay={decay_raw} scales the memory of ef=true; add ef=true or drop ef_decay")
    if cls.own_ef and (ef or ef21):  # a second memory on top of the compressor's own: ignore it
        _warn_once(name, f"ef={ef_raw} is ignored: {name} keeps its own error feedback (drop ef=)")
        ef = ef21 = False
    exchange = params.pop("exchange", cls.collective).lower()
    if ef21 and not cls.biased:
        raise SpecError(f"{name}: ef=ef21 is for biased compressors, and {name} is unbiased; drop ef=ef21")
    if ef21 and exchange != cls.collective:
        raise SpecError(f"{name}: ef=ef21 works with {name}'s own collective, not exchange={exchange}; "
                        f"drop exchange= or use ef=true")
    if exchange not in cls.schemes:
        what = "unknown exchange scheme" if exchange not in SCHEMES else f"{name} does not support exchange"
        raise SpecError(f"{name}: {what} {exchange!r}; {name} supports exchange={'|'.join(cls.schemes)}")
    fields = {f.name: f for f in dataclasses.fields(cls.Config)}
    hints = _hints(cls.Config)
    unknown = sorted(set(params) - set(fields))
    if unknown:
        valid = ", ".join([*fields, "ef", "exchange", "ef_decay"])
        raise SpecError(f"{name}: unknown parameter(s) {', '.join(unknown)}; valid parameters: {valid}")
    kwargs = {k: _convert(v, hints[k], name, k) for k, v in params.items()}
    try:
        config = cls.Config(**kwargs)
    except (ValueError, TypeError) as e:
        raise SpecError(f"{name}: {e}") from None
    comp = cls(config)
    comp.exchange = exchange
    if ef and (caveat := comp.ef_caveat()):
        _warn_once(name, caveat)
    if ef21:
        return EF21(comp)
    if ef:
        decay = 1.0 if decay_raw is None else _convert(decay_raw, float, name, "ef_decay")
        try:
            return ErrorFeedback(comp, decay=decay)
        except ValueError as e:
            raise SpecError(f"{name}: {e}") from None
    return comp


def _warn_once(name: str, caveat: str) -> None:
    if (name, caveat) not in _WARNED:
        _WARNED.add((name, caveat))  # once per process: specs are parsed again per worker and rank
        warnings.warn(f"{name}: {caveat}", stacklevel=3)


def describe(cls: type[Compressor]) -> list[tuple[str, str, Any]]:
    """(name, type name, default) of each parameter of ``cls``, ``ef`` and ``exchange`` last."""
    hints = _hints(cls.Config)
    rows = []
    for f in dataclasses.fields(cls.Config):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((f.name, getattr(hints[f.name], "__name__", str(hints[f.name])), default))
    rows.append(("ef", "bool", cls.default_ef))
    rows.append(("exchange", "|".join(cls.schemes), cls.collective))
    return rows
