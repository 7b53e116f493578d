"""Gradient compressors, error feedback and the registry of compressor specs.

>>> from gradzip.compress import create
>>> c = create("topk:ratio=0.01,ef=true")
"""

from gradzip.compress.base import Compressor, Payload
from gradzip.compress.registry import create, describe, parse_spec, register, registry

__all__ = ["Compressor", "Payload", "create", "describe", "parse_spec", "register", "registry"]
