"""``--sync sparseloco``'s error memory: its dtype (``ef_dtype=bf16``), that fp32 stays what it was,
that checkpoints hold it, and that a checkpoint of another chunking does not resume."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from torch import nn

from gradzip.cli import main
from gradzip.comm.sim import SimWorld
from gradzip.engine.config import EngineConfig
from gradzip.engine.diloco import DiLoCo
from gradzip.engine.modes import SyncSettings, build_synchronizer, load_modes
from gradzip.plan.sync import parse_sync

load_modes()  # registers --sync sparseloco


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


class _Stepper:
    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    def step(self, clip: bool = True) -> float:
        self.opt.step()
        self.opt.zero_grad()
        return 0.0

    def skip(self) -> None:
        raise AssertionError("no step is skipped")


def _run(sync_text: str, steps: int = 2, build=None) -> tuple[nn.Module, object]:
    """Two sim workers, SGD inner steps on fixed batches, ``steps`` steps of ``--sync sync_text``."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if build is None:
        sync = build_synchronizer(model, opt, SimWorld(2), SyncSettings(sync=parse_sync(sync_text),
                                                                        engine=EngineConfig()))
    else:
        sync = build(model, opt)
    for step in range(steps):
        for w in sync.worker_ids:
            with sync.worker(w):
                g = torch.Generator().manual_seed(100 * step + w)
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
                ((model(x) - y) ** 2).mean().backward()
                sync.after_backward(_Stepper(opt))
        stats = sync.synchronize()
        sync.commit(stats.nonfinite, _Stepper(opt))
    return model, sync


def _memories(sync) -> list[torch.Tensor]:
    return [m for c in sync.compressors for mems in c.memory.values() for m in mems]


def test_bf16_memory_halves_the_bytes_and_holds_the_fp32_residual_rounded():
    """One sync from a zero memory: the payloads, hence θ, are the fp32 run's bit for bit, and the bf16
    memory is the fp32 memory rounded to bf16; each worker's memory covers every parameter once, at 2
    bytes an element instead of 4."""
    n = sum(p.numel() for p in _model().parameters())
    m32, s32 = _run("sparseloco:every=2,k=8,beta=0.9")
    m16, s16 = _run("sparseloco:every=2,k=8,beta=0.9,ef_dtype=bf16")
    for a, b in zip(m32.parameters(), m16.parameters(), strict=True):
        assert torch.equal(a, b)
    mem32, mem16 = _memories(s32), _memories(s16)
    assert {m.dtype for m in mem32} == {torch.float32} and {m.dtype for m in mem16} == {torch.bfloat16}
    assert sum(m.numel() for m in mem16) == 2 * n  # two workers, one element per parameter each
    assert sum(m.numel() * m.element_size() for m in mem16) * 2 == sum(m.numel() * m.element_size() for m in mem32)
    assert any(m.abs().sum() > 0 for m in mem32)
    for a, b in zip(mem32, mem16, strict=True):
        assert torch.equal(a.to(torch.bfloat16), b)


def test_fp32_memory_is_the_codec_it_always_was():
    """``ef_dtype=fp32`` (and no ``ef_dtype``) is DiLoCo with the codec spec and an outer SGD, as before:
    the same floats over three syncs."""
    from gradzip.engine.sparseloco import codec_spec

    def before(model, opt):
        spec = parse_sync("sparseloco:every=2,k=8,beta=0.9")
        outer = torch.optim.SGD(list(model.parameters()), lr=1.0, momentum=0.0)
        return DiLoCo(model, opt, outer, SimWorld(2), 2, codec_spec(spec), min_compress_numel=0, hook=False)

    ref, _ = _run("", steps=6, build=before)
    for text in ("sparseloco:every=2,k=8,beta=0.9", "sparseloco:every=2,k=8,beta=0.9,ef_dtype=fp32"):
        model, _ = _run(text, steps=6)
        for a, b in zip(ref.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)


TINY = ["--model", "bert-tiny", "--seq-len", "32", "--batch-size", "4", "--workers", "2", "--eval-batches", "2",
        "--eval-every", "1", "--lr", "2e-3", "--warmup", "2", "--no-progress", "--dropout", "0", "--steps", "8"]


def test_bf16_memory_is_in_the_checkpoint_and_resumes_bit_identically(tmp_path, corpus):
    from test_diloco import computed

    args = [*TINY, "--corpus", str(corpus), "--sync", "sparseloco:every=4,k=16,ef_dtype=bf16"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["train", *args, "--out", str(full)]) == 0
    assert main(["train", *args, "--stop-at", "5", "--out", str(part)]) == 0
    engine = torch.load(next(part.glob("ckpt-*.pt")), weights_only=True)["own"]["engine"]
    mems = [m for c in engine["compressors"] for ms in c["memory"].values() for m in ms]
    assert mems and {m.dtype for m in mems} == {torch.bfloat16} and any(m.abs().sum() > 0 for m in mems)
    assert main(["train", "--out", str(part), "--resume"]) == 0
    assert computed(part) == computed(full)


def _digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in d.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, corpus):
    """A run of ``--sync sparseloco:every=2,chunk=16,k=8`` stopped at step 2 (a checkpoint)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    args = [*TINY, "--corpus", str(corpus), "--sync", "sparseloco:every=2,chunk=16,k=8", "--eval-every", "4"]
    assert main(["train", *args, "--stop-at", "2", "--out", str(out)]) == 0
    return out, args


@pytest.mark.parametrize("other", ["chunk=8", "k=4", "bits=3", "range=4", "index=rice", "ef_dtype=bf16"])
def test_resume_with_another_chunking_is_one_line_and_writes_nothing(stopped, other, capsys):
    out, args = stopped
    before = _digest(out)
    sync = f"sparseloco:every=2,chunk=16,k=8,{other}".replace("chunk=16,k=8,chunk=8", "chunk=8,k=8")
    sync = sync.replace("k=8,k=4", "k=4")
    argv = [a if a != "sparseloco:every=2,chunk=16,k=8" else sync for a in args]
    capsys.readouterr()
    assert main(["train", *argv, "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "--resume" in err and "different settings" in err and other.split("=")[0] in err
    assert _digest(out) == before
