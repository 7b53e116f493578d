"""``signsgd``: signSGD with majority vote (Bernstein et al. 2018).

Algorithm, per tensor:

1. Payload, as ``onebit``: the sign bits packed 8 per byte plus one fp32 scale = mean(|g|) of this
   rank's tensor: ceil(n / 8) + 4 bytes. (The paper sends signs only and leaves the magnitude to the
   learning rate; the 4-byte scale lets the update keep the gradient's order of magnitude, so the
   same learning rates as plain SGD work.)
2. Allgather; each rank decodes every payload to scale_r * sign_r.
3. Majority vote: update = sign(sum over ranks of sign_r) * mean over ranks of scale_r. A tie (even
   number of ranks, equal votes) gives 0: no step on that coordinate. A rank whose scale is 0 (an
   all-zero gradient) abstains from the vote; its 0 still counts in the mean scale.

Biased, and no error feedback by default, as in the paper (``signsgd:ef=true`` adds it, with the
residual taken against this rank's own scaled signs). The vote makes it robust to a minority of
bad ranks. Tuning: use with momentum on the workers' side (Signum) for best results; expect a gap
to SGD on heterogeneous data, which ``onebit`` (error feedback) closes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradzip.compress.base import Payload, numel_of
from gradzip.compress.bitpack import decode_vote
from gradzip.compress.onebit import SignCode
from gradzip.compress.registry import register


@register("signsgd")
class SignSGD(SignCode):
    description = "signSGD with majority vote: packed signs + fp32 scale, sign of the vote * mean scale"
    default_ef = False

    def aggregate(self, tensors: list[Tensor]) -> Tensor:
        # Each decoded tensor is scale_r * (±1): torch.sign recovers the vote exactly, and any
        # element's magnitude is scale_r.
        votes = torch.sign(tensors[0]).to(torch.float32)
        for t in tensors[1:]:
            votes += torch.sign(t)
        n = tensors[0].numel()
        scales = [t.reshape(-1)[0].abs().float() for t in tensors] if n else [torch.zeros(())]
        mean_scale = torch.stack(scales).mean()
        return (torch.sign(votes) * mean_scale).to(tensors[0].dtype)

    def decode_aggregate(self, payloads: list[Payload], ctx: tuple[torch.Size, torch.dtype]) -> Tensor | None:
        # The vote counted on the packed bits (bitpack.majority_signs), then one decode. Every
        # rank must vote: a scale that is 0 or not finite in the gradient's dtype (an abstaining
        # or broken rank) takes the general path.
        shape, dtype = ctx
        n = numel_of(shape)
        if payloads[0][1].device.type != "cpu":  # its vote check reads the scales on the host: there,
            return None  # the general path's elementwise decode is cheaper than stalling the stream
        scales = torch.stack([p[1].to(dtype).float().abs().reshape(()) for p in payloads])
        if type(self).decompress is not SignCode.decompress or n == 0 or \
                not bool((torch.isfinite(scales) & (scales > 0)).all()):  # CPU: a read, not a stall
            return None
        return decode_vote([p[0] for p in payloads], n, scales.mean(), dtype).view(shape)
