"""DeMo, Decoupled Momentum Optimization (Peng, Quesnelle & Kingma 2024, arXiv 2411.19870).

Each rank keeps its own momentum δ and sends only its fast-moving part; the update is the sign of
the ranks' mean of what was sent. Per step, rank and parameter tensor (θ, local gradient g):

1. δ ← decay·δ + lr·g (g is this rank's local gradient, not averaged);
2. the chunked 2-D DCT-II of δ (orthonormal, chunk × chunk; 1-D tensors in 1-D chunks);
3. the top-k coefficients per chunk are sent: bit-packed indices and values;
4. δ ← δ − inverse DCT of what this rank sent (δ keeps the rest: its error feedback);
5. a fixed-size allgather of indices and values;
6. the mean over ranks, decoded deterministically (sum in rank order, divide by the world size);
7. the inverse DCT, its sign, and SGD with decoupled weight decay:
   θ ← θ·(1 − lr·wd) − lr·sign(mean).

Steps 1–6 are the ``demo`` compressor (:mod:`gradzip.compress.demo`); this optimizer does the lr
scaling of step 1 and step 7. Two modes:

- inside ``gradzip train --optimizer demo`` (``comm=None``): the engine runs the ``demo``
  compressor; :meth:`DeMo.exchange_plan` makes it scale each bucket's local gradient by the current lr
  (the plan's ``transform``), so p.grad arrives as the decoded mean and :meth:`DeMo.step` applies step
  7. ``grad_is_update`` is True, so the loop does not clip p.grad (clipping would not change a sign).
  Tensors the engine sends uncompressed (below ``--min-compress-numel``) arrive as the exact mean
  of lr·g: DeMo with every coefficient sent (δ is then 0 after each step), i.e. signSGD for them.
  ``--min-compress-numel 0`` sends every tensor through the DCT, as the paper does. The
  ``compression_*`` arguments are unused there: the ``demo:...`` spec sets them. ``--compressor
  distro:...`` (:mod:`gradzip.compress.distro`) takes steps 1–6 instead, as Psyche's DisTrO sends them.
- standalone (``comm``: a :class:`gradzip.comm.base.Communicator`, one rank per process, the same
  parameters on every rank): :meth:`DeMo.step` compresses lr·p.grad with its own ``demo``
  compressor (keyed per parameter), exchanges it (:class:`gradzip.engine.exchange.Exchange`) and
  applies step 7. Every rank must step the same parameters (those whose grad is not None). Its
  ``state_dict`` holds the compressor's δ (``"demo"``). No non-finite check: a NaN poisons δ.

Weight decay skips what the param groups say (``gradzip train``: biases and LayerNorm).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from gradzip.comm.base import Communicator
from gradzip.compress.demo import DeMoCompressor, DeMoConfig
from gradzip.engine.exchange import Exchange
from gradzip.engine.synchronizer import ExchangePlan


class DeMo(torch.optim.Optimizer):
    """See the module docstring. ``lr``: the step size of the sign update, as in SGD."""

    def __init__(self, params: Iterable[Any], lr: float, compression_decay: float = 0.999,
                 compression_topk: int = 32, compression_chunk: int = 64, weight_decay: float = 0.0,
                 comm: Communicator | None = None) -> None:
        if not lr >= 0 or not weight_decay >= 0:
            raise ValueError(f"DeMo: need lr >= 0 and weight_decay >= 0, got lr={lr}, weight_decay={weight_decay}")
        config = DeMoConfig(topk=compression_topk, chunk=compression_chunk, decay=compression_decay)
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.comm = comm
        self.compressor = DeMoCompressor(config) if comm is not None else None
        self._lr_of: dict[int, dict[str, Any]] = {}

    @property
    def frozen(self) -> bool:
        """Always True: p.grad holds what the sign step takes (``gradzip train`` then skips clipping)."""
        return True

    @property
    def grad_is_update(self) -> bool:
        """Always True: p.grad holds what the sign step takes, so it is not clipped."""
        return True

    def exchange_plan(self) -> ExchangePlan:
        """Before each step of ``gradzip train``: the engine compresses lr·(local gradient)
        (:class:`gradzip.engine.synchronizer.ShapesExchange`)."""
        self._lr_of = {id(p): g for g in self.param_groups for p in g["params"]}
        return ExchangePlan(compress=True, transform=self._scale_by_lr)

    def configure(self, engine: Any) -> None:
        """Set ``engine`` up for the next step by hand (``engine.bind_optimizer(opt)`` does it at
        every step)."""
        engine.set_plan(self.exchange_plan())

    @torch.no_grad()
    def _scale_by_lr(self, bucket: Any, buf: Tensor) -> None:
        """In place: each parameter's segment of the bucket's local gradient times its group's lr."""
        for p, off, n in zip(bucket.params, bucket.offsets, bucket.numels):
            buf.narrow(0, off, n).mul_(self._lr_of[id(p)]["lr"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [(g, p) for g in self.param_groups for p in g["params"]]
        todo = [(g, i, p) for i, (g, p) in enumerate(params) if p.grad is not None and p.numel()]
        means = [p.grad for _, _, p in todo] if self.comm is None else self._exchange(todo)
        for (group, _, p), mean in zip(todo, means):
            lr, wd = group["lr"], group["weight_decay"]
            if wd:
                p.mul_(1 - lr * wd)
            p.add_(torch.sign(mean).to(p.dtype), alpha=-lr)
        return loss

    def _exchange(self, todo: list[tuple[dict[str, Any], int, Tensor]]) -> list[Tensor]:
        """Steps 1–6 for every parameter, standalone (key ``p<i>``: the i-th parameter of the groups):
        every exchange is launched, then each is waited for, in order."""
        assert self.compressor is not None and self.comm is not None
        exchanges = []
        for group, i, p in todo:
            ex = Exchange(self.compressor, self.comm, [p.grad.mul(group["lr"])], key=f"p{i}")
            ex.start()
            exchanges.append(ex)
        means = []
        for ex in exchanges:
            while not ex.advance():
                pass
            means.append(ex.result()[0])
        return means

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        if self.compressor is not None:
            sd["demo"] = self.compressor.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        demo = state_dict.pop("demo", None)
        super().load_state_dict(state_dict)
        if demo is not None and self.compressor is not None:
            self.compressor.load_state_dict(demo)
