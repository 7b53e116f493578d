"""Randomness of a run: one seed for everything, and one dropout stream per worker."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from gradzip.errors import GradzipError


def seed_everything(seed: int) -> None:
    """Seed torch (all devices), numpy and Python: same seed, same model init and same run."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class WorkerRNG:
    """One torch RNG stream per worker, used for dropout while that worker computes.

    Worker ``w`` draws from the same stream whether it is a ``sim`` worker or real rank ``w``,
    so ``sim`` and real backends see the same dropout masks, and a worker's masks do not depend
    on how many workers ran before it in the same process. Checkpointed per worker.
    """

    def __init__(self, seed: int, worker_ids: list[int], device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        with torch.random.fork_rng(devices=[device] if self.cuda else []):
            for w in worker_ids:
                ws = int(np.random.SeedSequence([seed, w]).generate_state(1, dtype=np.uint64)[0] % 2**63)
                torch.manual_seed(ws)
                self.states[w] = self._get()

    def _get(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.get_rng_state(), (torch.cuda.get_rng_state() if self.cuda else None)

    def _set(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if self.cuda and state[1] is not None:
            torch.cuda.set_rng_state(state[1])

    @contextlib.contextmanager
    def use(self, w: int) -> Iterator[None]:
        """Make worker ``w``'s stream the global torch RNG for the duration."""
        self._set(self.states[w])
        try:
            yield
        finally:
            self.states[w] = self._get()

    def state_dict(self) -> dict[str, Any]:
        ws = sorted(self.states)
        return {"workers": ws, "cpu": [self.states[w][0] for w in ws],
                "cuda": [self.states[w][1] for w in ws] if self.cuda else []}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sorted(sd["workers"]) != sorted(self.states):
            raise GradzipError(f"checkpoint has RNG streams for workers {sd['workers']}, "
                               f"this process runs workers {sorted(self.states)}")
        for i, w in enumerate(sd["workers"]):
            cuda = sd["cuda"][i] if self.cuda and sd["cuda"] else self.states[w][1]
            self.states[w] = (sd["cpu"][i], cuda)
