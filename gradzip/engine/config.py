"""The engine's options: :class:`EngineConfig` (part of every rank's start-up fingerprint)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gradzip.errors import GradzipError

INTRA_DTYPES = {"": None, "native": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class EngineConfig:
    """Engine options (identical on every rank: they are part of the start-up fingerprint).

    bucket_cap_mb: bucket size cap in MiB (DDP's default 25).
    min_compress_numel: tensors with fewer elements are exchanged uncompressed (0: compress all).
    broadcast: broadcast parameters and floating-point buffers from rank 0 at start-up.
    check: compare model/compressor/options fingerprints across ranks at start-up.
    agree: the caller's settings that must be equal on every rank (``gradzip train``: its whole
        resolved configuration), compared with the fingerprint; a mismatch names the fields.
    hierarchical: reduce inside each node, compress only across nodes
        (:mod:`gradzip.engine.hierarchical`); nodes come from the launcher, or ``SimWorld``'s
        ``ranks_per_node``.
    intra_dtype: the intra-node wire dtype of the hierarchical exchange: ``""`` or ``"native"``
        (the gradient's), ``"fp16"`` or ``"bf16"``.
    """

    bucket_cap_mb: float = 25.0
    min_compress_numel: int = 1024
    broadcast: bool = True
    check: bool = True
    agree: dict[str, Any] = field(default_factory=dict)
    hierarchical: bool = False
    intra_dtype: str = ""

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise GradzipError(f"bucket_cap_mb must be > 0 (MiB, e.g. 25), got {self.bucket_cap_mb}")
        if self.min_compress_numel < 0:
            raise GradzipError(f"min_compress_numel must be >= 0 (0 compresses every tensor), got "
                               f"{self.min_compress_numel}")
        if self.intra_dtype not in INTRA_DTYPES:
            raise GradzipError(f"intra_dtype must be one of {', '.join(repr(k) for k in INTRA_DTYPES)}, got "
                               f"{self.intra_dtype!r}")
