"""Assignment of parameters to gradient buckets.

Rules (identical on every rank, so that the collectives of all ranks match):

1. Walk the trainable parameters in *reverse* registration order (``model.parameters()``
   reversed), as DDP does: backward produces the last layers' gradients first, so buckets filled in
   this order become ready early and their exchange overlaps the rest of backward.
2. A bucket holds parameters of one dtype and device (one flat buffer, one collective) and of one
   *kind*: ``compressed`` (numel >= ``min_compress_numel``) or ``plain`` (small tensors such as
   biases and LayerNorm weights, exchanged uncompressed: compressing a few hundred elements saves
   nothing and costs a latency-bound collective plus encode/decode).
3. A bucket is closed when the next parameter would push it over ``cap_bytes`` (a parameter bigger
   than the cap gets a bucket of its own).
4. Buckets are ordered by the position of their *last* parameter in the walk, i.e. by the time
   they are expected to become ready. (Ordering by the first parameter would put a plain bucket
   that collects every bias of the model first, and since a bucket launches only after all
   lower-index buckets have launched, it would hold back every compressed bucket until the end of
   backward.)

Parameters with no elements are not bucketed: their averaged gradient is the empty tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gradzip.errors import GradzipError

MiB = 1024 * 1024


@dataclass
class Bucket:
    """One flat buffer's worth of parameters, exchanged by one :class:`Exchange`.

    ``offsets[i]``/``numels[i]``/``shapes[i]`` locate parameter ``params[i]`` in the flat buffer.
    """

    index: int
    dtype: torch.dtype
    device: torch.device
    compressed: bool
    params: list[torch.nn.Parameter] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)
    shapes: list[torch.Size] = field(default_factory=list)
    numel: int = 0
    last_pos: int = 0  # position of the last parameter in the reverse walk (the sort key)

    @property
    def key(self) -> str:
        """Compressor state key: stable across steps and identical on every rank."""
        return f"bucket{self.index}"

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def add(self, name: str, param: torch.nn.Parameter, pos: int) -> None:
        self.params.append(param)
        self.names.append(name)
        self.offsets.append(self.numel)
        self.numels.append(param.numel())
        self.shapes.append(param.shape)
        self.numel += param.numel()
        self.last_pos = pos

    def __repr__(self) -> str:
        kind = "compressed" if self.compressed else "plain"
        return f"<Bucket {self.index} {kind} {self.dtype} {len(self.params)} params {self.numel} elements>"


def assign_buckets(named_params: Sequence[tuple[str, torch.nn.Parameter]], cap_bytes: int,
                   min_compress_numel: int, separate_small: bool = True) -> list[Bucket]:
    """Bucket the trainable, non-empty parameters of ``named_params`` (registration order).

    ``separate_small=False`` puts every parameter in the compressed kind (used when the compressor
    is ``none`` anyway, so that small tensors do not cost extra collectives).
    """
    open_: dict[tuple[torch.dtype, torch.device, bool], Bucket] = {}
    closed: list[Bucket] = []
    walk = [(n, p) for n, p in named_params if p.requires_grad and p.numel() > 0]
    for pos, (name, p) in enumerate(reversed(walk)):
        compressed = (not separate_small) or p.numel() >= min_compress_numel
        group = (p.dtype, p.device, compressed)
        b = open_.get(group)
        size = p.numel() * p.element_size()
        if b is not None and b.params and b.nbytes + size > cap_bytes:
            closed.append(b)
            b = None
        if b is None:
            b = open_[group] = Bucket(index=-1, dtype=p.dtype, device=p.device, compressed=compressed)
        b.add(name, p, pos)
    closed.extend(b for b in open_.values() if b.params)
    closed.sort(key=lambda b: b.last_pos)
    for i, b in enumerate(closed):
        b.index = i
    return closed


def coalesce(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Group tensors by dtype and device into runs of at most ``cap_bytes`` (for the start-up
    broadcast: fewer, larger messages, bounded temporary memory)."""
    groups: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        g = (t.dtype, t.device)
        runs = groups.setdefault(g, [[]])
        size = t.numel() * t.element_size()
        if runs[-1] and sizes[g] + size > cap_bytes:
            runs.append([])
            sizes[g] = 0
        runs[-1].append(t)
        sizes[g] = sizes.get(g, 0) + size
    return [run for runs in groups.values() for run in runs if run]


def fragment_cap(total_bytes: int, cap_bytes: int, parts: int) -> int:
    """The bucket cap when the model syncs in ``parts`` fragments (Streaming DiLoCo): at most
    1/(2·parts) of the model's bytes, so that :func:`split_fragments` finds enough whole buckets to
    make ``parts`` groups of about equal size whatever ``--bucket-cap-mb`` says (BERT-tiny fits in
    two 25 MiB buckets). One fragment: ``cap_bytes`` unchanged."""
    return cap_bytes if parts <= 1 else max(1, min(cap_bytes, -(-total_bytes // (2 * parts))))


def split_fragments(numels: list[int], parts: int) -> list[list[int]]:
    """Bucket indices (launch order) in ``parts`` contiguous groups of about equal elements: a bucket
    opens the next group when the running total at its middle passes the group's share, or when
    every group still empty needs one of the buckets left. Streaming DiLoCo's fragments, in the
    engine (:mod:`gradzip.engine.diloco`) and in ``gradzip simulate`` alike."""
    if parts > len(numels):
        raise GradzipError(f"fragments={parts} but the model has only {len(numels)} "
                           f"bucket{'s' if len(numels) > 1 else ''}; lower fragments or --bucket-cap-mb (buckets "
                           "are the smallest unit a fragment can hold)")
    total = sum(numels)
    out: list[list[int]] = [[] for _ in range(parts)]
    acc, k = 0, 0
    for i, numel in enumerate(numels):
        left = len(numels) - i
        if k < parts - 1 and out[k] and (acc + numel / 2 > total * (k + 1) / parts or left <= parts - 1 - k):
            k += 1
        out[k].append(i)
        acc += numel
    return out
