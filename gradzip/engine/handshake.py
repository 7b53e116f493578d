"""Start-up agreement between ranks: the fingerprint check and the broadcast from rank 0.

Both run before any hook is registered. With the ``sim`` backend the collectives run through the
:class:`SimWorld` too (every worker launches, then every worker waits), so that start-up bytes
are counted exactly as on a real backend, even though the one shared model makes them no-ops.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradzip.comm.base import Communicator
from gradzip.errors import GradzipError
from gradzip.plan.buckets import coalesce


def fingerprint(named_params: Sequence[tuple[str, torch.nn.Parameter]], spec: str, options: dict[str, Any],
                agree: dict[str, Any] | None = None) -> bytes:
    """A small JSON document: a digest of the parameters' names, shapes, dtypes and
    requires_grad flags, their count and size (for the error message), the canonical compressor
    spec, the engine options that decide bucketing (so that collectives match) and the caller's
    settings that must agree (``agree``)."""
    h = hashlib.sha256()
    for name, p in named_params:
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|{int(p.requires_grad)};".encode())
    doc = {
        "model": h.hexdigest()[:32],
        "params": len(named_params),
        "numel": sum(p.numel() for _, p in named_params),
        "spec": spec,
        "options": options,
        "agree": agree or {},
    }
    return json.dumps(doc, sort_keys=True).encode()


def _allgather_all(comms: Sequence[Communicator], tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    handles = [c.allgather_async(t) for c, t in zip(comms, tensors)]  # launch on all, then wait
    return [h.wait() for h in handles]


def check_agreement(comms: Sequence[Communicator], docs: Sequence[bytes]) -> None:
    """Allgather every local worker's fingerprint; raise :class:`GradzipError` on every rank if
    any rank differs from rank 0, naming the ranks and what differs."""
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in docs]
    gathered = _allgather_all(comms, tensors)[0]
    problems = disagreements([json.loads(bytes(t.tolist()).decode()) for t in gathered])
    if problems:
        raise GradzipError("ranks disagree at start-up: " + "; ".join(problems)
                           + "; every rank must build the same model (names, shapes, dtypes) and pass the same "
                           "compressor spec, engine options and settings")


def disagreements(parsed: Sequence[dict[str, Any]]) -> list[str]:
    """What differs from rank 0 in the ranks' fingerprint documents (empty: all agree)."""
    ref = parsed[0]
    problems: list[str] = []
    for what, field_, show in (
        ("model", "model", lambda d: f"{d['params']} parameters / {d['numel']} elements"),
        ("compressor spec", "spec", lambda d: repr(d["spec"])),
        ("engine options", "options", lambda d: json.dumps(d["options"], sort_keys=True)),
    ):
        bad = [r for r, d in enumerate(parsed) if d[field_] != ref[field_]]
        if bad:
            others = ", ".join(f"rank {r}: {show(parsed[r])}" for r in bad)
            problems.append(f"{what} differs on rank(s) {bad} (rank 0: {show(ref)}; {others})")
    agree0 = ref.get("agree", {})
    for key in sorted(set().union(*(d.get("agree", {}) for d in parsed))):
        bad = [r for r, d in enumerate(parsed) if d.get("agree", {}).get(key) != agree0.get(key)]
        if bad:
            others = ", ".join(f"rank {r}: {parsed[r].get('agree', {}).get(key)!r}" for r in bad)
            problems.append(f"{key} differs on rank(s) {bad} (rank 0: {agree0.get(key)!r}; {others})")
    return problems


@torch.no_grad()
def broadcast_state(comms: Sequence[Communicator], tensors: Sequence[Tensor], cap_bytes: int, shared: bool) -> None:
    """Overwrite ``tensors`` on every rank with rank 0's values, in coalesced messages of at most
    ``cap_bytes``. ``shared``: all ``comms`` are workers of one process sharing these tensors
    (``sim``), so each passes the same flat buffer and nothing needs copying back."""
    for run in coalesce(tensors, cap_bytes):
        flat = torch.cat([t.detach().reshape(-1) for t in run])
        handles = [c.broadcast_async(flat, 0) for c in comms]
        for h in handles:
            h.wait()
        if not shared:
            offset = 0
            for t in run:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

