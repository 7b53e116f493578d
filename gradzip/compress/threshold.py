"""``threshold``: hard-threshold sparsification: send every entry with |g| >= tau (Strom 2015).

Algorithm, per tensor (any shape, read flat; fp32, fp16 or bf16):

1. Select the indices i with |g_i| >= tau, compared in fp32 (tau rounded to fp32). NaN is never
   selected; ±inf is (the engine skips a step whose gradients are not finite anyway).
2. Cap (``max_ratio < 1``): if more than k_max = max(1, ceil(max_ratio * n)) entries pass, keep
   the k_max largest |g| among them (exact top-k, :mod:`gradzip.compress.select`).
3. Payload: (values in the tensor's dtype, ascending int32 indices): c * (itemsize + 4) bytes for
   the c selected entries, 0 <= c <= k_max. c depends on the data, so the payload's size differs
   between ranks and steps (``fixed_size = False``: the engine exchanges the sizes first). A rank
   that selects nothing sends two empty tensors; all ranks selecting nothing gives zeros.
4. Allgather; each rank scatters every payload into zeros and the ranks' tensors are averaged.

Bytes: a data-dependent size has no exact formula, so ``payload_bytes`` is the upper bound
k_max * (itemsize + 4) (with the default ``max_ratio=1``: n * (itemsize + 4), more than ``none``);
the bytes really sent are in the engine's step statistics (counted from the tensors on the wire).

Biased (entries below tau never arrive): use it with error feedback (``threshold:tau=1e-3,ef=true``),
which accumulates the small entries until they pass tau. Tuning: tau is in the gradient's units, so
it depends on the model, the loss scale and the learning-rate schedule; look at the sent bytes in
the step statistics and set tau (or ``max_ratio``, which bounds the traffic of a step whose
gradients are all large, e.g. the first ones) so that about 0.1-1% of the entries pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradzip.compress.base import Compressor, Payload, numel_of
from gradzip.compress.fastpaths import DecodeAggregate, SubtractSent
from gradzip.compress.registry import register
from gradzip.compress.select import topk_indices
from gradzip.compress.topk import _SELF_VALUES, TopK, _Ctx, k_of


@dataclass
class ThresholdConfig:
    tau: float = 1e-3  # send the entries with |g| >= tau; tau > 0, in the gradient's units
    max_ratio: float = 1.0  # at most ceil(max_ratio * n) entries (the largest); 0 < max_ratio <= 1

    def __post_init__(self) -> None:
        if not 0.0 < self.tau < float("inf"):
            raise ValueError(f"tau must be a finite number > 0, e.g. 1e-3; got {self.tau!r}")
        if not 0.0 < self.max_ratio <= 1.0:
            raise ValueError(f"max_ratio must be 0 < max_ratio <= 1 (1: no cap), e.g. 0.01; got {self.max_ratio!r}")


@register("threshold")
class Threshold(DecodeAggregate, SubtractSent, Compressor):
    collective = "allgather"
    schemes = ("allgather",)
    biased = True
    fixed_size = False
    description = "hard threshold: values + int32 indices of the entries with |g| >= tau (variable size)"
    Config = ThresholdConfig
    host_syncs = "nonzero() reads the number of entries over tau on the host: the payload's size"

    def compress(self, tensor: Tensor, key: str = "") -> tuple[Payload, _Ctx]:
        flat = tensor.detach().reshape(-1)
        if flat.numel() >= 2**31:
            raise ValueError(f"threshold indices are int32: tensors must have < 2^31 elements, got {flat.numel()}")
        passed = flat.float().abs() >= self.config.tau  # NaN compares False
        idx = passed.nonzero().view(-1).to(torch.int32)
        k_max = k_of(self.config.max_ratio, flat.numel())
        if idx.numel() > k_max:  # the k_max largest of the passed entries (all of them >= tau)
            idx = topk_indices(torch.where(passed, flat, flat.new_zeros(())), k_max)
        return (flat[idx], idx), _Ctx(tensor.shape, tensor.dtype)

    decompress = TopK.decompress  # top-k's payload: scatter into zeros
    decode_aggregate = TopK.decode_aggregate  # and the ranks' payloads: one index_add_
    subtract_sent = TopK.subtract_sent

    def payload_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        """An upper bound (the size depends on the data): k_max * (itemsize + 4)."""
        return k_of(self.config.max_ratio, numel_of(shape)) * (torch.empty((), dtype=dtype).element_size() + 4)


_SELF_VALUES.add(Threshold.compress)  # its values are the input's entries too: fused EF zeroes them
