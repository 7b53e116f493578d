"""Gradient-exchange engine: bucketing, overlap, the sim driver and the DDP adapter.

>>> from gradzip.engine import attach
>>> engine = attach(model, "topk:ratio=0.01,ef=true", comm)   # doctest: +SKIP
"""

from gradzip.engine.clock import StepStats
from gradzip.engine.engine import Engine, EngineConfig, attach

__all__ = ["Engine", "EngineConfig", "StepStats", "attach"]
