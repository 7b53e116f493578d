"""The cache-blocked outer step (gradzip/engine/outer_step.py) gives torch.optim.SGD's floats."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradzip
from gradzip.comm.sim import SimWorld
from gradzip.engine.outer_step import CHUNK, fusable, fused_sgd_step

SHAPES = [(CHUNK + 13,), (3, 5), (2 * CHUNK // 300 + 1, 300), (1,)]  # blocks with tails, tiny tensors

CONFIGS = [
    dict(lr=0.7, momentum=0.9, nesterov=True),
    dict(lr=1.0),
    dict(lr=0.5, momentum=0.8, dampening=0.1),
    dict(lr=0.3, momentum=0.9, nesterov=True, weight_decay=0.01),
]


@pytest.mark.parametrize("alpha", [0.0, 0.5])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("foreach", [True, False])
def test_fused_step_is_bit_identical_to_torch_sgd(config, alpha, foreach):
    g = torch.Generator().manual_seed(0)
    ref = [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    mine = [nn.Parameter(p.detach().clone()) for p in ref]
    locals_ref = [torch.randn(s, generator=g) for s in SHAPES]
    locals_mine = [t.clone() for t in locals_ref]
    opt_ref = torch.optim.SGD(ref, foreach=foreach, **config)
    opt = torch.optim.SGD(mine, foreach=foreach, **config)
    assert fusable(opt)
    for _ in range(3):  # the first step creates the momentum buffers, later ones update them
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        for p, d in zip(ref, grads):
            p.grad = d.clone()
        opt_ref.step()
        for t, p in zip(locals_ref, ref):
            t.copy_(p.detach()) if alpha == 0 else t.lerp_(p.detach(), 1 - alpha)
        fused_sgd_step(opt, [(p, p.detach(), d.clone(), [t]) for p, d, t in zip(mine, grads, locals_mine)], alpha)
        for a, b in zip(ref, mine):
            assert torch.equal(a.detach(), b.detach())
        for a, b in zip(locals_ref, locals_mine):
            assert torch.equal(a, b)
    sd_ref, sd = opt_ref.state_dict()["state"], opt.state_dict()["state"]
    assert sd_ref.keys() == sd.keys()
    for k in sd_ref:
        assert sd_ref[k].keys() == sd[k].keys()
        if sd_ref[k].get("momentum_buffer") is not None:
            assert torch.equal(sd_ref[k]["momentum_buffer"], sd[k]["momentum_buffer"])


def test_fusable_refuses_what_it_cannot_reproduce():
    p = [nn.Parameter(torch.zeros(3))]
    assert not fusable(torch.optim.Adam(p))
    assert not fusable(type("MySGD", (torch.optim.SGD,), {})(p, lr=1.0))  # a subclass may step differently
    assert not fusable(torch.optim.SGD(p, lr=1.0, maximize=True))
    assert not fusable(torch.optim.SGD(p, lr=torch.tensor(1.0)))
    assert not fusable(torch.optim.SGD(p, lr=1.0, fused=True))  # its own one-pass kernel, its own floats
    hooked = torch.optim.SGD(p, lr=1.0)
    handle = hooked.register_step_post_hook(lambda *a: None)
    assert not fusable(hooked)
    handle.remove()
    assert fusable(hooked)
    scheduled = torch.optim.SGD(p, lr=1.0)
    torch.optim.lr_scheduler.StepLR(scheduled, 1)  # wraps step() to count its calls
    assert not fusable(scheduled)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(40, 300), nn.Linear(300, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class StepSGD(torch.optim.SGD):
    """Not fusable (a subclass): DiLoCo calls its step()."""


@pytest.mark.parametrize("alpha", [0.0, 0.25])
def test_diloco_fused_equals_outer_step(alpha):
    """DiLoCo on sim with the fused outer step ends bit-identical to the same run through step()."""
    models = []
    for cls in (torch.optim.SGD, StepSGD):
        model = Net()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        outer = cls(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        d = gradzip.DiLoCo(model, inner, outer, SimWorld(3), 2, "topk:ratio=0.1,ef=true", fragments=2,
                           fragment_update_alpha=alpha, bucket_cap_mb=0.02)
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            for w in d.worker_ids:
                with d.worker(w):
                    model(torch.randn(8, 40, generator=g)).square().mean().backward()
                    inner.step()
                    inner.zero_grad()
        models.append((model, d, outer))
    (m1, d1, o1), (m2, d2, o2) = models
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(d1.global_, d2.global_))
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(o1.state[p1]["momentum_buffer"], o2.state[p2]["momentum_buffer"])
