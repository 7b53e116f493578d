"""The engine's per-worker state: buffers, exchanges in flight and timings of one step."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradzip.cluster.schedule import BucketTiming, Mark
from gradzip.comm.base import Communicator
from gradzip.compress.base import Compressor, unflatten
from gradzip.engine.exchange import Exchange
from gradzip.plan.buckets import Bucket


class _Hook:
    """A hook that a copy of the model does not inherit: ``copy.deepcopy(model)`` (EMA models,
    reference replicas) gives an unattached model instead of trying to copy the engine."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> None:
        if self.fn is not None:
            self.fn(*args)

    def __deepcopy__(self, memo: dict) -> _Hook:
        return _Hook(None)

    def __reduce__(self) -> tuple:
        return (_Hook, (None,))


class _Worker:
    """One (virtual) worker: its communicator, compressor, bucket buffers and per-step state."""

    def __init__(self, wid: int, comm: Communicator, compressor: Compressor, buckets: list[Bucket]) -> None:
        self.id, self.comm, self.compressor = wid, comm, compressor
        self.scheme: Any = None  # SchemeState or HierarchicalScheme, built after the start-up check
        self.buffers: list[Tensor | None] = [None] * len(buckets)
        self.snap = comm.stats.snapshot()
        self.stateful: list[Compressor] = [compressor]  # + the scheme's (server memory): undoable steps
        self.open = False  # a step whose state updates skip_step() may still undo
        self.reset(buckets)

    def reset(self, buckets: list[Bucket]) -> None:
        nb = len(buckets)
        self.ready = [bytearray(len(b.params)) for b in buckets]
        self.pending = [len(b.params) for b in buckets]
        self.next_launch = 0
        self.exchanges: list[Exchange | None] = [None] * nb
        self.timing = [BucketTiming(0.0, 0.0) for _ in range(nb)]
        self.pack_s = [0.0] * nb
        self.entered = self.flushed = False
        self.t_start: float | None = None
        self.fwd_start: float | None = None
        self.t_end: float | None = None
        self.hook_s = 0.0  # engine time inside hooks (lies within forward+backward)
        self.sums: list[Tensor] = []  # per launched bucket: fp32 sum of the local gradient (inf/NaN check)
        self.fin_s = 0.0   # engine compute time outside hooks (flush, next rounds, decode)
        self.marks: list[Mark] = []  # real backends: this step's schedule, absolute times
        self.launched: dict[int, float] = {}  # bucket -> when its current round was launched

    def buffer(self, b: Bucket) -> Tensor:
        buf = self.buffers[b.index]
        if buf is None:
            buf = self.buffers[b.index] = torch.empty(b.numel, dtype=b.dtype, device=b.device)
        return buf


def write_back(b: Bucket, result: list[Tensor]) -> None:
    """Put bucket ``b``'s averaged gradient (one flat tensor, or one per parameter) into ``p.grad``."""
    per_tensor = len(result) == len(b.shapes) and all(r.shape == s for r, s in zip(result, b.shapes))
    parts = result if per_tensor else unflatten(result[0], b.shapes)
    for p, avg in zip(b.params, parts):
        if p.grad is None:
            p.grad = avg.detach().clone()
        else:
            p.grad.copy_(avg)
