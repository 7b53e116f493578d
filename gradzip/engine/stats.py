"""What one exchange step reports: :class:`StepStats` (the model behind ``sim``'s modelled times is
:mod:`gradzip.cluster.schedule`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class StepStats:
    """What one :meth:`Engine.finalize` reports, for one rank (``sim``: mean over workers).

    compute_s: forward + backward (excluding the engine's own work).
    compress_s: engine work on the compute thread: packing, encoding, decoding, unpacking.
    comm_s: *exposed* communication: time waiting for the network beyond what backward hid.
    bytes_sent / bytes_recv: this rank's bytes on the wire this step (all rounds).
    step_s: compute_s + compress_s + comm_s (sim, modelled) or the measured wall time from the
        first forward to the end of finalize (real backends); excludes the optimizer step.
    clock: ``"modelled"`` (sim) or ``"measured"``.
    link_s: total communication time, overlapped or not (sim: modelled α–β time of every
        collective; real: the backend's measured time per collective, which overlaps).
    buckets: number of buckets exchanged.
    intra_bytes_sent: the part of ``bytes_sent`` that stayed inside the node (hierarchical
        exchange; sim with ``ranks_per_node``); the rest crossed between nodes.
    nonfinite: how many of this process's workers had an inf or NaN in their local gradient
        (real backends: 0 or 1; see :meth:`Engine.agree_finite` and :meth:`Engine.skip_step`).
    syncs: synchronisations completed this step (per-step exchange: 1; DiLoCo: fragments applied).
    by_collective: sharded training: ``bytes_sent`` split into ``allgather`` (parameters),
        ``reduce_scatter`` and ``allreduce`` (HSDP's replicas); None for the other modes.
    probe_bytes: ``--compressor auto``: the part of ``bytes_sent`` that the policy sent after the
        step's exchange (its link probe and the ranks' agreements; ``sim``: what they would send),
        so that the run's bytes and compression figure include them; 0 for the other modes.
    ft: ``--sync ftdiloco``/``ftsparseloco``: the sync's quorum, participants, heals and bytes per participant
        (``metrics.jsonl``'s ``ft``); None for the other modes and on steps without a sync.
    """

    compute_s: float
    compress_s: float
    comm_s: float
    bytes_sent: int
    bytes_recv: int
    step_s: float
    clock: str
    link_s: float = 0.0
    buckets: int = 0
    intra_bytes_sent: int = 0
    nonfinite: int = 0
    syncs: int = 1
    by_collective: dict[str, int] | None = None
    probe_bytes: int = 0
    ft: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, float | int | str]:
        return asdict(self)
