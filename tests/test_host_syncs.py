"""No host syncs on an accelerator: the contract's ``host_syncs`` declaration, held to the code.

On a GPU, reading a device value on the host (``.item()``, ``float(t)``, ``bool(t)``, ``nonzero``,
``bincount`` without a known size) makes the host wait for every kernel queued before it, so the
next bucket's encode cannot overlap the network. A compressor whose ``host_syncs`` is ``""``
promises its encode, its rounds and its decode never do. There is no GPU here, but the ``meta``
device takes the same branches as CUDA (every fast path tests ``device.type == "cpu"``) and has no
values to read: a host read raises. So each registered compressor, bare, with error feedback and
with EF21, runs whole exchanges on meta tensors through the real :class:`Exchange` (two ranks, to
reach ``aggregate``), and

- runs through, if it declares no host sync;
- fails, if it declares one (so a stale declaration is noticed when the sync is removed).

``python -m gradzip.bench.gpu_check`` counts the syncs on a real GPU with CUDA's sync debug mode.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from gradzip.comm.base import Communicator, DoneHandle, Handle
from gradzip.compress import create, registry
from gradzip.engine.exchange import Exchange

META = torch.device("meta")
SHAPES = [(256, 512), (4096,), (33,)]


class MetaComm(Communicator):
    """Rank 0 of two identical ranks, on meta tensors: every collective is shape-only."""

    backend = "meta"

    def __init__(self) -> None:
        super().__init__(0, 2)

    def allreduce_async(self, tensor, op="sum") -> Handle:
        return DoneHandle(tensor if op == "mean" else tensor * 2)

    def allgather_async(self, tensor, same_shape=False) -> Handle:
        return DoneHandle([tensor, tensor.clone()])

    def broadcast_async(self, tensor, src=0) -> Handle:
        return DoneHandle(tensor)

    def alltoall_async(self, tensor) -> Handle:
        return DoneHandle(tensor.clone())

    def split(self, colour, key=None) -> Communicator:
        raise NotImplementedError

    def barrier(self) -> None:
        pass


def _specs() -> list[str]:
    out = []
    for name, cls in registry().items():
        out += [name, f"{name}:ef=true"] + ([f"{name}:ef=ef21"] if cls.biased and not cls.own_ef else [])
    return out


def _create(spec: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # EF on an unbiased compressor warns; here it is on purpose
        return create(spec)


def _steps(spec: str, dtype: torch.dtype, steps: int = 3) -> list[torch.Tensor]:
    """``steps`` whole exchanges of one bucket on meta tensors (error memory carried between them)."""
    c = _create(spec)
    out: list[torch.Tensor] = []
    for _ in range(steps):
        c.begin_step()
        ex = Exchange(c, MetaComm(), [torch.empty(s, device=META, dtype=dtype) for s in SHAPES], key="b")
        ex.start()
        while not ex.advance():
            pass
        out = ex.result()
        c.end_step(True)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", _specs())
def test_the_declared_host_syncs_are_the_real_ones(spec: str, dtype: torch.dtype) -> None:
    declared = _create(spec).host_syncs
    if not declared:
        out = _steps(spec, dtype)
        assert [(tuple(t.shape), t.dtype) for t in out] == [(s, dtype) for s in SHAPES]
        return
    with pytest.raises((RuntimeError, NotImplementedError), match="(?i)meta"):  # a host read of a meta value
        _steps(spec, dtype)


def test_the_issues_gpu_targets_never_wait_for_the_device() -> None:
    """The compressors the GPU path is measured on (fp16/bf16, 1-bit + EF, top-k + EF, PowerSGD
    + EF) must queue their whole exchange without a host sync."""
    for spec in ("fp16", "bf16", "onebit", "topk:ratio=0.01,ef=true", "powersgd:rank=4,ef=true"):
        assert create(spec).host_syncs == "", spec


def test_every_declaration_gives_a_reason() -> None:
    for name, cls in registry().items():
        assert isinstance(cls.host_syncs, str), name
        assert cls.host_syncs == "" or len(cls.host_syncs.split()) >= 4, f"{name}: say why it syncs"


def test_gpu_checks_sync_count_names_the_compressors_that_wait() -> None:
    """gpu_check's ``host-syncs`` on a GPU: the warnings of CUDA's sync debug mode, counted per
    spec while the mode is on, after a warm-up call whose one-time syncs do not count. Here a fake
    mode switch and compressors that warn as CUDA would stand in for the GPU."""
    from gradzip.bench.gpu_check import check_host_syncs

    mode = {"now": "default"}
    fp16 = type(create("fp16"))

    class Syncing(fp16):
        name = "syncing"

        def compress(self, tensor, key=""):
            if mode["now"] == "warn":  # the check records these warnings
                warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
            return super().compress(tensor, key)

    class FirstCallOnly(fp16):
        name = "lazy"
        calls = 0

        def compress(self, tensor, key=""):
            type(self).calls += 1
            if type(self).calls == 1 and mode["now"] == "warn":  # lazy initialisation: the warm-up
                warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)  # absorbs it
            return super().compress(tensor, key)

    res = check_host_syncs(torch.device("cpu"), [Syncing(), FirstCallOnly(), create("onebit")],
                           set_mode=lambda m: mode.update(now=m))
    assert res["syncs"] == {"syncing": 1}  # the bucket is encoded as one flat tensor
    assert not res["ok"] and res["detail"].startswith("2/3 specs") and mode["now"] == "default"
    assert check_host_syncs(torch.device("cpu"), [create("onebit")], set_mode=lambda m: None)["ok"]
