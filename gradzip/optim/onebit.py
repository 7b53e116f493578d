"""1-bit Adam and 1-bit LAMB: optimizers that compress the momentum instead of the gradient.

1-bit Adam (Tang et al., ICML 2021) and 1-bit LAMB (Li et al., 2021), on any compressor and
exchange scheme of gradzip's engine (``gradzip train`` uses ``onebit:exchange=twophase``, the
papers' compressed allreduce with error feedback on both sides). Two stages:

1. **Warm-up**, steps 1..``freeze_step``: plain Adam (LAMB), bias-corrected, on the gradient
   averaged *uncompressed* (the engine's :class:`~gradzip.engine.synchronizer.ExchangePlan`).
2. **Compression**, after ``freeze_step``: the variance v stops changing (it is frozen, with its
   bias correction, at the end of warm-up). Each rank turns its local gradient g into its local
   momentum m_i = β1·m + (1−β1)·g inside the engine (the plan's ``transform``, before compression);
   the engine exchanges m_i compressed, with error feedback, and delivers the average in
   ``p.grad``; the optimizer adopts it as its momentum m (the same on every rank) and steps with
   the frozen v: u = m̂ / (√v̂_frozen + ε) + λ·w.

1-bit LAMB also freezes each tensor's trust ratio r = ‖w‖/‖u‖ at the end of warm-up and, in the
compression stage, scales it by how much a *fresh* variance would change the update: v_fresh
follows the gradient reconstructed from consecutive averaged momenta, g̃ = (m_t − β1·m_{t−1}) /
(1−β1), and r = r_frozen · clamp(‖m̂/(√v̂_fresh+ε)‖ / ‖m̂/(√v̂_frozen+ε)‖, 0.5, 4) (the clamp as
DeepSpeed's defaults). That is our reading of the paper's Algorithm 1, not a copy of its code.

Why freezing works: for BERT, Adam's variance stabilises early (Tang et al. Fig. 1), and a frozen
v makes the update linear in m, so compressing m with error feedback behaves like compressed
momentum SGD with a fixed per-coordinate preconditioner. Tuning: ``freeze_step`` of 15–25% of the
run (the papers: 15–23k of 100k+ steps for BERT-Large); too early and v is still moving.
Gradient clipping applies in warm-up only (in the compression stage ``p.grad`` is a momentum).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from gradzip.engine.synchronizer import ExchangePlan
from gradzip.optim.lamb import adam_state, trust_ratio

FACTOR_MIN, FACTOR_MAX = 0.5, 4.0


class OneBitAdam(torch.optim.Optimizer):
    """See the module docstring. ``lamb=True`` gives 1-bit LAMB (param groups with ``adapt``)."""

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, freeze_step: int, lamb: bool = False) -> None:
        if freeze_step < 1:
            raise ValueError(f"freeze_step must be >= 1 (the variance needs warm-up steps), got {freeze_step}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adapt=lamb))
        self.freeze_step, self.lamb = freeze_step, lamb
        for g in self.param_groups:
            g.setdefault("steps_done", 0)

    @property
    def frozen(self) -> bool:
        """True once warm-up is over: the next step exchanges and adopts the momentum."""
        return self.param_groups[0]["steps_done"] >= self.freeze_step

    @property
    def grad_is_update(self) -> bool:
        """After warm-up ``p.grad`` holds the averaged momentum, which is not clipped."""
        return self.frozen

    def exchange_plan(self) -> ExchangePlan:
        """What the engine exchanges next step: uncompressed gradients in warm-up, the compressed
        local momentum afterwards (:class:`gradzip.engine.synchronizer.ShapesExchange`)."""
        return ExchangePlan(compress=self.frozen, transform=self._local_momentum if self.frozen else None)

    def configure(self, engine: Any) -> None:
        """Set ``engine`` up for the next step by hand (``engine.bind_optimizer(opt)`` does it at
        every step)."""
        engine.set_plan(self.exchange_plan())

    @torch.no_grad()
    def _local_momentum(self, bucket: Any, buf: Tensor) -> None:
        """In place: the bucket's local gradient g → m_i = β1·m + (1−β1)·g."""
        if not hasattr(self, "_beta1"):  # the groups' β1 by parameter, once (groups do not change)
            self._beta1 = {id(p): g["betas"][0] for g in self.param_groups for p in g["params"]}
        for p, off, n in zip(bucket.params, bucket.offsets, bucket.numels):
            b1 = self._beta1.get(id(p), 0.0)
            seg = buf.narrow(0, off, n).mul_(1 - b1)
            m = self.state.get(p, {}).get("exp_avg")
            if m is not None:
                seg.add_(m.reshape(-1).to(seg.dtype), alpha=b1)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compress = self.frozen
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                st = self.state[p]
                t, m, v = adam_state(st, p)
                if not compress:
                    m.mul_(beta1).add_(g, alpha=1 - beta1)
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    st["v_hat_scale"] = torch.tensor(1 / (1 - beta2**t))  # v's bias correction, kept at the freeze
                else:
                    if self.lamb and group["adapt"]:
                        fresh = st.setdefault("exp_avg_sq_fresh", v.clone())
                        rec = (g - beta1 * m) / (1 - beta1)  # the gradient the two averaged momenta imply
                        fresh.mul_(beta2).addcmul_(rec, rec, value=1 - beta2)
                    m.copy_(g)  # the averaged momentum the engine delivered
                m_hat = m / (1 - beta1**t)
                update = m_hat / ((v * st["v_hat_scale"]).sqrt_().add_(group["eps"]))
                if group["weight_decay"]:
                    update.add_(p.float(), alpha=group["weight_decay"])
                ratio = self._ratio(group, p, st, update, m_hat, compress)
                p.add_((update * ratio).to(p.dtype), alpha=-group["lr"])
            group["steps_done"] += 1
        return loss

    def _ratio(self, group: dict[str, Any], p: Tensor, st: dict[str, Any], update: Tensor, m_hat: Tensor,
               compress: bool) -> Tensor:
        if not (self.lamb and group["adapt"]):
            return torch.ones((), device=p.device)
        if not compress:  # LAMB's own ratio; the last one of warm-up is the frozen one
            st["ratio"] = trust_ratio(p, update)
            return st["ratio"]
        eps = group["eps"]
        frozen_u = m_hat / ((st["exp_avg_sq"] * st["v_hat_scale"]).sqrt() + eps)
        fresh_u = m_hat / ((st["exp_avg_sq_fresh"] * st["v_hat_scale"]).sqrt() + eps)
        den = frozen_u.norm()
        factor = (fresh_u.norm() / den).clamp(FACTOR_MIN, FACTOR_MAX) if den > 0 else torch.ones(())
        return st.get("ratio", torch.ones(())) * torch.nan_to_num(factor, nan=1.0)
