"""DiLoCo's per-rank state: checkpoints (``state_dict``/``load_state_dict``), and on ``sim`` the
swap of each worker's inner optimizer state and parameters in and out of the one model.

:class:`DiLoCoState` is a mixin of :class:`gradzip.engine.diloco.DiLoCo`: it reads and writes the
attributes that class sets up (θ_global per bucket, the replicas, the exchanges in flight) and keeps
no state of its own.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from gradzip.compress.base import flatten, unflatten
from gradzip.errors import GradzipError
from gradzip.plan.buckets import Bucket
from gradzip.plan.sync import SyncSpec


class DiLoCoState:
    """Checkpoints and sim's per-worker swaps of :class:`~gradzip.engine.diloco.DiLoCo` (module docstring)."""

    # set up by DiLoCo.__init__
    spec: str
    sync: SyncSpec
    worker_ids: list[int]
    sim: bool
    inner: torch.optim.Optimizer
    outer: torch.optim.Optimizer
    buckets: list[Bucket]
    global_: list[Tensor]
    replicas: list[list[Tensor]]
    inner_states: list[dict[Any, Any]]
    compressors: list[Any]
    schemes: list[Any]
    step: int
    _inflight: dict[int, list[list[Any]]]
    _results: dict[int, dict[str, Any]]
    _compute_since: dict[int, float]
    _link_idle: float
    _finish: Any  # DiLoCo's: drive one fragment's exchanges to the end

    def state_dict(self) -> dict[str, Any]:
        """Per rank: θ_global, the outer optimizer, every compressor and scheme state, exchanges in
        flight (finished now, their averages kept), and the local parameters and inner optimizer
        state (sim: every worker's). Tensors and numbers only (``weights_only=True`` loads it)."""
        for f in list(self._inflight):
            res, _, link, sent = self._finish(f)
            self._results[f] = {"results": res, "bytes": sent, **({"link": link} if self.sync.overlap else {})}
        sd: dict[str, Any] = {
            "spec": self.spec, "sync": str(self.sync), "worker_ids": self.worker_ids, "step": self.step,
            "global": [g.clone() for g in self.global_], "outer": self.outer.state_dict(),
            "compressors": [c.state_dict() for c in self.compressors],
            "schemes": [s.state_dict() for s in self.schemes],
            "pending": {str(f): v for f, v in self._results.items()},
            "compute_since": {str(f): v for f, v in self._compute_since.items()},
        }
        if self.sync.overlap:  # sim's model of the one link (overlap=1 only: older states stay as they were)
            sd["link_idle"] = self._link_idle
        if self.sim:
            sd["replicas"] = [[t.clone() for t in rep] for rep in self.replicas]
            sd["inner"] = [{"state": st, "param_groups": self.inner.state_dict()["param_groups"]}
                           for st in self.inner_states]
        else:
            sd["replicas"] = [[_flat(b).clone() for b in self.buckets]]
            sd["inner"] = [self.inner.state_dict()]
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("spec") != self.spec or sd.get("sync") != str(self.sync):
            raise GradzipError(f"DiLoCo state is for {sd.get('spec')!r} with sync {sd.get('sync')!r}, not "
                               f"{self.spec!r} with {self.sync}; resume with the same settings")
        if list(sd.get("worker_ids", [])) != self.worker_ids:
            raise GradzipError(f"DiLoCo state is for workers {sd.get('worker_ids')}, this process hosts "
                               f"{self.worker_ids}; resume with the same backend and number of workers")
        self.step = int(sd["step"])
        with torch.no_grad():
            for g, s in zip(self.global_, sd["global"]):
                g.copy_(s)
        self.outer.load_state_dict(sd["outer"])
        for c, s in zip(self.compressors, sd["compressors"]):
            c.load_state_dict(s)
        for sc, s in zip(self.schemes, sd["schemes"]):
            sc.load_state_dict(s)
        self._inflight.clear()
        self._results = {int(f): {"results": v["results"], "bytes": list(v["bytes"]),
                                  **({"link": float(v["link"])} if "link" in v else {})}
                         for f, v in sd["pending"].items()}
        self._link_idle = float(sd.get("link_idle", math.inf))
        self._compute_since = {int(f): float(v) for f, v in sd["compute_since"].items()}
        if self.sim:
            for rep, s in zip(self.replicas, sd["replicas"]):
                for t, v in zip(rep, s):
                    t.copy_(v)
            for i, s in enumerate(sd["inner"]):
                self.inner.load_state_dict(s)  # torch's casts to the parameters' devices apply here
                self._swap_out(i)
            _load(self.buckets, self.replicas[0])
        else:
            _load(self.buckets, sd["replicas"][0])
            self.inner.load_state_dict(sd["inner"][0])


    def _swap_in(self, i: int) -> None:
        """Sim: make worker i's inner optimizer state the optimizer's, through its own
        ``load_state_dict`` (its hooks run; fused and foreach steps see a state they
        built themselves). The param groups stay the ones it holds: the LR schedule's lr and every
        other group setting are the same for all workers, as the one optimizer steps them all."""
        mine = self.inner_states[i]
        self.inner.load_state_dict({"state": mine, "param_groups": self.inner.state_dict()["param_groups"]})
        if not mine:
            return
        # torch casts loaded state to its parameter's dtype: a swap must give back what it took.
        now = self.inner.state_dict()["state"]
        for k, entry in mine.items():
            for name, v in entry.items() if isinstance(entry, dict) else ():
                w = now.get(k, {}).get(name) if isinstance(now.get(k), dict) else None
                if isinstance(v, Tensor) and isinstance(w, Tensor) and w.dtype != v.dtype:
                    raise GradzipError(
                        f"DiLoCo on sim: {type(self.inner).__name__}.load_state_dict turns worker {i}'s state "
                        f"{name!r} from {v.dtype} into {w.dtype}, so the workers' inner states cannot be swapped "
                        "through it; use an optimizer whose state keeps its parameters' dtype, or a real backend")

    def _swap_out(self, i: int) -> None:
        """Sim: keep the optimizer's state (its ``state_dict()``'s, the live tensors) as worker i's."""
        self.inner_states[i] = self.inner.state_dict()["state"]



def _flat(b: Bucket) -> Tensor:
    return flatten([p.detach() for p in b.params]).clone() if len(b.params) > 1 else b.params[0].detach().reshape(-1)


@torch.no_grad()
def _load(buckets: list[Bucket], flats: list[Tensor]) -> None:
    for b, v in zip(buckets, flats):
        for p, src in zip(b.params, unflatten(v, b.shapes)):
            p.copy_(src)


@torch.no_grad()
def _store(buckets: list[Bucket], flats: list[Tensor]) -> None:
    for b, v in zip(buckets, flats):
        for p, dst in zip(b.params, unflatten(v, b.shapes)):
            dst.copy_(p.reshape(dst.shape))

