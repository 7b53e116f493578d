"""Gradient-exchange engine: bucketing, overlap, the sim driver and the DDP adapter.

>>> from gradzip.engine import attach
>>> engine = attach(model, "topk:ratio=0.01,ef=true", comm)   # doctest: +SKIP
"""

from gradzip.engine.engine import Engine, EngineConfig, attach
from gradzip.engine.stats import StepStats

__all__ = ["Engine", "EngineConfig", "StepStats", "attach"]
