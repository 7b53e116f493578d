"""``exchange=sparse``: gTop-k, a sparse allreduce of top-k payloads (Shi et al., "A Distributed
Synchronous SGD Algorithm with Global Top-k Sparsification for Low Bandwidth Networks", ICDCS 2019).

Per bucket of N elements, with k = the compressor's k for N, on n ranks (p = the largest power of
two <= n):

1. Each rank selects its local top-k (values, indices), with its error memory under ``ef=true``.
2. Fold (only when n is not a power of two): rank p+j sends its set to rank j (a broadcast in the
   pair's sub-communicator), which merges it into its own.
3. Recursive doubling over the p ranks: at level i, rank r and rank r XOR 2^i exchange their sets
   (a two-rank allgather), each sums the two sets index by index and keeps the top k of the sum.
   Both partners compute the same set, so after log2(p) levels every rank holds the same k entries.
4. Unfold: rank j sends the final set back to rank p+j.
5. The result is the final set divided by n, scattered into a dense bucket.

Error feedback: whatever a merge drops (partial sums of the pair's subtrees) goes back into the
memory of one rank, the lowest of the ranks computing that merge (a compressor with a memory implements
:class:`gradzip.compress.fastpaths.Credit`; without one, they are lost).
Every local entry is thus either in the final set or, as part of one partial sum, in exactly one
memory, and the invariant of the flat exchange holds for the sum over ranks:
Σ_r (g_r + m_r − m_r') = n · result. (The paper instead returns to each rank its own entries
whose index is not in the final set, which loses the contributions dropped at an intermediate
level at indices that a later level selects again.)

Per-rank traffic: 8k bytes per level (fp32 value + int32 index), so 8k·log2(n) (+16k when n is not a
power of two) instead of the allgather's 8k·(n−1).

What it changes numerically, against the allgather of every rank's top k:

- The result keeps k entries, not up to n·k: entries outside the global top k are dropped
  (and, under EF, kept in the owners' memories for later steps).
- The selection is hierarchical, so it is not exactly the top k of the summed gradient: a level
  drops an index whose partial sum is small even if other ranks' contributions would have lifted it.
- Residuals sit in the memory of the rank that dropped them, not of the rank whose gradient they
  came from; the next step's sum over ranks (all that the mean update sees) is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradzip.comm.base import Communicator, Handle
from gradzip.compress.base import Compressor, flatten, unflatten
from gradzip.compress.fastpaths import Credit
from gradzip.compress.select import topk_indices
from gradzip.engine.exchange import pack, unpack, wait_all


@dataclass
class Step:
    """One round of the plan on this rank: ``kind`` is fold, pair or unfold; ``comm`` the
    two-rank sub-communicator, or a one-rank one when this rank sits the round out."""

    kind: str
    comm: Communicator
    credits: bool = False  # this rank keeps what the round's merge drops (once per distinct merge)

    @property
    def active(self) -> bool:  # read at run time: a sim split is bound once every worker split
        return self.comm.world_size == 2


def build_plan(comm: Communicator) -> list[Step]:
    """The pair sub-communicators of every round (collective: call it on every rank at set-up)."""
    r, n = comm.rank, comm.world_size
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    solo = n + r  # a colour nobody else uses: this rank sits the round out
    steps: list[Step] = []
    fold = comm.split(r - p if r >= p else (r if r < extra else solo)) if extra else None
    if fold is not None:
        steps.append(Step("fold", fold, credits=r < extra))
    level = 1
    while level < p:
        # After level L the 2L ranks of a block hold the same set, so the L pairs between two
        # blocks compute the same merge: only the pair of the blocks' first ranks credits it.
        pair = comm.split(min(r, r ^ level) if r < p else solo)
        steps.append(Step("pair", pair, credits=r < p and r % (2 * level) == 0))
        level <<= 1
    if fold is not None:
        steps.append(Step("unfold", fold))
    return steps


def sparse_plan(compressor: Compressor, comm: Communicator) -> list[Step] | None:
    """The ``sparse`` scheme's per-rank state (:mod:`gradzip.compress.schemes`): the pair plan of
    :func:`build_plan` on more than one rank, else None."""
    return build_plan(comm) if comm.world_size > 1 else None


def merge(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor], k: int
          ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """(kept, dropped): the k entries of largest |sum| of two sparse sets (values, indices),
    summed by index, and the rest. Deterministic: the same two sets in the same order give the
    same result on every rank."""
    idx = torch.cat([a[1], b[1]])
    vals = torch.cat([a[0], b[0]])
    uniq, inv = torch.unique(idx, sorted=True, return_inverse=True)
    summed = torch.zeros(uniq.numel(), dtype=vals.dtype, device=vals.device).index_add_(0, inv, vals)
    if uniq.numel() <= k:
        return (summed, uniq), (summed[:0], uniq[:0])
    keep = torch.zeros(uniq.numel(), dtype=torch.bool, device=vals.device)
    keep[topk_indices(summed, k).long()] = True  # ascending, ties to the lowest index
    return (summed[keep], uniq[keep]), (summed[~keep], uniq[~keep])


class SparseExchange:
    """One bucket's gTop-k (see the module docstring); the Exchange interface."""

    def __init__(self, compressor: Compressor, plan: list[Step], comm: Communicator,
                 tensors: Sequence[Tensor], key: str) -> None:
        self.compressor, self.plan, self.comm = compressor, plan, comm
        self.tensors = list(tensors)
        self.shapes = [t.shape for t in self.tensors]
        self.key = key
        self.rounds = len(plan)
        self.round = 0
        self.compress_s = 0.0
        self.link_s = [0.0] * self.rounds
        self._handle: Handle | None = None
        self._result: list[Tensor] | None = None

    def start(self) -> None:
        t0 = self.comm.work_time()
        flat = flatten(self.tensors)
        self.numel, self.dtype = flat.numel(), flat.dtype
        payload, _ = self.compressor.compress_batch([flat], self.key)
        if len(payload) != 2 or payload[1].dtype not in (torch.int32, torch.int64):
            raise TypeError(f"exchange=sparse needs a (values, indices) payload; {self.compressor.name} gave "
                            f"{[str(t.dtype) for t in payload]}")
        self.mine = (payload[0].float(), payload[1].to(torch.int32))
        self.k = self.mine[1].numel()
        self.set = self.mine
        self.compress_s += self.comm.work_time() - t0
        self._launch()

    def _launch(self) -> None:
        step = self.plan[self.round]
        c = step.comm
        if not step.active:
            self._handle = None
        elif step.kind == "pair":
            self._handle = c.allgather_async(pack(self.set), same_shape=True)  # k entries on both
        else:  # fold: the upper rank (sub-rank 1) sends; unfold: the lower one (sub-rank 0) does
            src = 1 if step.kind == "fold" else 0
            buf = pack(self.set) if c.rank == src else torch.empty(8 * self.k, dtype=torch.uint8,
                                                                     device=self.set[0].device)
            self._handle = c.broadcast_async(buf, src)

    def advance(self) -> bool:
        if self._result is not None:
            return True
        step = self.plan[self.round]
        if self._handle is not None:
            (got,) = wait_all([self._handle], self.link_s, self.round)
            t0 = self.comm.work_time()
            if step.kind == "pair":
                sets = [unpack(g, self.set) for g in got]
                self.set, dropped = merge(sets[0], sets[1], self.k)  # (lower's, upper's): same order on both
                if step.credits:
                    self._credit(dropped)
            elif step.kind == "fold" and step.comm.rank == 0:
                self.set, dropped = merge(self.set, unpack(got, self.set), self.k)
                self._credit(dropped)
            elif step.kind == "unfold" and step.comm.rank == 1:
                self.set = unpack(got, self.set)
            self.compress_s += self.comm.work_time() - t0
        if self.round + 1 < self.rounds:
            self.round += 1
            self._launch()
            return False
        self._finish()
        return True

    def _credit(self, dropped: tuple[Tensor, Tensor]) -> None:
        if dropped[1].numel() and isinstance(self.compressor, Credit):
            self.compressor.credit(self.key, dropped[1].long(), dropped[0])

    def _finish(self) -> None:
        t0 = self.comm.work_time()
        vals, idx = self.set
        out = torch.zeros(self.numel, dtype=self.dtype, device=vals.device)
        out[idx.long()] = (vals / self.comm.world_size).to(self.dtype)
        self._result = unflatten(out, self.shapes) if len(self.shapes) > 1 else [out.view(self.shapes[0])]
        self.compress_s += self.comm.work_time() - t0

    def result(self) -> list[Tensor]:
        if self._result is None:
            raise RuntimeError("SparseExchange.result() before the exchange finished")
        return self._result
