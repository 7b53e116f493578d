"""gradzip inside the trainers researchers use (``gradzip.integrations``), by running the shipped
examples as a user would: the Hugging Face Trainer and accelerate under ``torchrun`` with 2 CPU
processes, Lightning under its own launcher, all on gloo with default DDP (which rebuilds its
buckets after step 1), each with ``onebit`` and with top-k + EF; the same trainers sharding with FSDP2 and
``gradzip.fsdp_compress`` (accelerate around a ``fully_shard``-ed model, Lightning's
``ModelParallelStrategy``), with ``none`` and top-k + EF. Plus the hook state that binds
late, the single-process warning and the DeepSpeed/FSDP refusal, in this process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the integration tests need `pip install gradzip[hf]`")

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SPECS = ["onebit", "topk:ratio=0.01,ef=true"]
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GRADZIP_FAULT"):
        env.pop(k, None)
    return env


def torchrun(script: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / script), *args]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def replicas_identical(out: Path) -> None:
    a, b = (torch.load(out / f"replica-rank{r}.pt", weights_only=True) for r in range(2))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the replicas diverged"


def hf_losses(out: Path) -> dict[int, float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


# ---------------------------------------------------------------------- Hugging Face Trainer
@pytest.mark.parametrize("spec", SPECS)
def test_hf_trainer_trains_logs_and_resumes_with_the_error_memory(spec, tmp_path):
    """12 steps: the loss falls, the replicas are identical and log_history holds the gradzip/
    figures. 6 steps + a checkpoint + resume gives the uninterrupted losses of steps 7-12. The
    Trainer's own resume is exact here (data order, RNG states, optimizer), and so is the restored
    error memory; what is not is DDP's bucket layout: a resumed process starts again from DDP's
    first layout for one step, so a statistic over the bucket (onebit's scale, a mean) adds in
    another order. Top-k + EF (a selection, no sums over the bucket) comes back bit for bit; onebit
    within 1e-5, while the same resume without the error memory is off by far more."""
    full, part = tmp_path / "full", tmp_path / "part"
    torchrun("hf_trainer.py", "--compressor", spec, "--steps", "12", "--out", str(full))
    replicas_identical(full)
    history = json.loads((full / "trainer_state.json").read_text())["log_history"]
    steps = [h for h in history if "loss" in h]
    assert len(steps) == 12
    assert sum(h["loss"] for h in steps[-3:]) < sum(h["loss"] for h in steps[:3]), "the loss did not fall"
    for h in steps:
        assert h["gradzip/steps"] == 1 and h["gradzip/bytes_per_step"] > 0
        assert h["gradzip/compression_ratio"] > 5 and h["gradzip/compress_s_per_step"] >= 0

    torchrun("hf_trainer.py", "--compressor", spec, "--steps", "12", "--stop-at", "6", "--out", str(part))
    ckpt = part / "checkpoint-6"
    assert sorted(p.name for p in ckpt.glob("gradzip-rank*.pt")) == ["gradzip-rank0.pt", "gradzip-rank1.pt"]
    memory = torch.load(ckpt / "gradzip-rank1.pt", weights_only=True)["compressor"]["memory"]
    assert memory and all(float(t.abs().sum()) > 0 for ts in memory.values() for t in ts)
    if spec == "onebit":  # without the error memory the resumed run is another run
        bare = tmp_path / "bare"
        shutil.copytree(part, bare)
        for f in (bare / "checkpoint-6").glob("gradzip-rank*.pt"):
            f.unlink()
        p = torchrun("hf_trainer.py", "--compressor", spec, "--steps", "12", "--out", str(bare), "--resume")
        assert "not found; the error memory starts from zero" in p.stderr
        off = max(abs(hf_losses(bare)[s] - hf_losses(full)[s]) for s in range(8, 13))
        assert off > 1e-3, off
    torchrun("hf_trainer.py", "--compressor", spec, "--steps", "12", "--out", str(part), "--resume")
    resumed, ref = [hf_losses(part)[s] for s in range(7, 13)], [hf_losses(full)[s] for s in range(7, 13)]
    if spec.startswith("topk"):
        assert resumed == ref
    else:
        assert resumed == pytest.approx(ref, rel=1e-5)
    replicas_identical(part)


def test_hf_single_process_warns_and_trains(tmp_path, monkeypatch):
    from transformers import Trainer, TrainingArguments

    sys.path.insert(0, str(EXAMPLES))
    monkeypatch.chdir(tmp_path)
    from toy_mlm import Patterns, tiny_bert

    from gradzip.integrations.transformers import GradzipCallback

    args = TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=2, per_device_train_batch_size=4,
                             report_to="none", use_cpu=True, save_strategy="no", logging_steps=1)
    trainer = Trainer(model=tiny_bert(), args=args, train_dataset=Patterns(n=16),
                      callbacks=[GradzipCallback("onebit")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    msgs = [str(w.message) for w in caught if "GradzipCallback" in str(w.message)]
    assert len(msgs) == 1 and "single process" in msgs[0] and "\n" not in msgs[0]
    assert trainer.state.global_step == 2


def test_hf_deepspeed_and_fsdp_are_refused_with_one_line():
    from types import SimpleNamespace

    from gradzip.errors import GradzipError
    from gradzip.integrations.transformers import GradzipCallback

    cb = GradzipCallback("onebit")
    for args in (SimpleNamespace(deepspeed="ds.json", fsdp=""), SimpleNamespace(deepspeed=None, fsdp="full_shard")):
        with pytest.raises(GradzipError, match="DeepSpeed and FSDP") as e:
            cb.on_train_begin(args, SimpleNamespace(global_step=0), None)
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------------- Lightning, accelerate
@pytest.mark.parametrize("spec", SPECS)
def test_lightning_ddp_strategy_built_before_the_process_group(spec, tmp_path):
    pytest.importorskip("lightning", reason="needs `pip install gradzip[lightning]`")
    out = tmp_path / "l"
    p = subprocess.run([sys.executable, str(EXAMPLES / "lightning_ddp.py"), "--compressor", spec, "--steps", "12",
                        "--out", str(out)], env=_env(), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    replicas_identical(out)
    (metrics,) = out.glob("lightning_logs/version_*/metrics.csv")
    header, *rows = [line.split(",") for line in metrics.read_text().splitlines()]
    col = {name: i for i, name in enumerate(header)}
    ratios = [float(r[col["gradzip/compression_ratio"]]) for r in rows if r[col["gradzip/compression_ratio"]]]
    assert len(ratios) == 12 and min(ratios) > 5  # compressed: the callback put the hook on (CPU)
    losses = [float(r[col["loss"]]) for r in rows if r[col["loss"]]]
    assert sum(losses[-3:]) < sum(losses[:3])
    (ckpt,) = out.glob("lightning_logs/version_*/checkpoints/*.ckpt")
    ranks = torch.load(ckpt, weights_only=True)["gradzip"]["ranks"]
    assert len(ranks) == 2 and all(r["compressor"]["memory"] for r in ranks)
    assert ranks[0]["compressor"]["memory"].keys() == ranks[1]["compressor"]["memory"].keys()


@pytest.mark.parametrize("spec", SPECS)
def test_accelerate_prepare_then_register(spec, tmp_path):
    pytest.importorskip("accelerate", reason="needs `pip install gradzip[hf]`")
    out = tmp_path / "a"
    torchrun("accelerate_ddp.py", "--compressor", spec, "--steps", "12", "--out", str(out))
    replicas_identical(out)
    res = torch.load(out / "losses-rank0.pt", weights_only=True)
    assert len(res["losses"]) == 12 and sum(res["losses"][-3:]) < sum(res["losses"][:3])
    assert res["figures"]["steps"] == 12 and res["figures"]["compression_ratio"] > 5


# ---------------------------------------------------------------------- FSDP2: fsdp_compress
FSDP_SPECS = ["none", "topk:ratio=0.1,ef=true"]


def fsdp_figures_hold(spec: str, ratios: list[float], losses: list[float], out: Path) -> None:
    """Every step reduced through gradzip; ``none`` sends what FSDP2's fp32 reduce-scatter would
    (this BERT's shards need no padding), top-k + EF about a fifth; the loss fell; each rank saved
    its own error memory (the spec's)."""
    assert len(ratios) == 12 and len(losses) == 12
    if spec == "none":
        assert all(r == pytest.approx(1.0) for r in ratios)
    else:
        assert all(4 < r < 6 for r in ratios)  # 10% of the values with their int32 indices
    assert sum(losses[-3:]) < sum(losses[:3]), "the loss did not fall"
    states = [torch.load(out / f"gradzip-rank{r}.pt", weights_only=True) for r in range(2)]
    assert all(sd["mesh"] == [2, 1] for sd in states)
    memory = [sd["compressor"].get("memory", {}) for sd in states]
    if spec == "none":
        assert memory == [{}, {}]
    else:
        assert memory[0].keys() == memory[1].keys() and len(memory[0]) >= 3
        assert all(float(t.abs().sum()) > 0 for m in memory for ts in m.values() for t in ts)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", FSDP_SPECS)
def test_accelerate_fully_shard_then_fsdp_compress(spec, tmp_path):
    pytest.importorskip("accelerate", reason="needs `pip install gradzip[hf]`")
    out = tmp_path / "a"
    torchrun("accelerate_fsdp.py", "--compressor", spec, "--steps", "12", "--out", str(out))
    res = [torch.load(out / f"losses-rank{r}.pt", weights_only=True) for r in range(2)]
    figures = res[0]["figures"]
    assert figures["steps"] == 12 and figures["bytes_per_step"] > 0
    assert figures["collectives"]["alltoall"]["calls"] == 12 * 3  # 3 FSDP units, one reduce-scatter each per step
    assert res[1]["figures"]["bytes_per_step"] == figures["bytes_per_step"]  # fixed-size payloads
    fsdp_figures_hold(spec, [figures["compression_ratio"]] * 12, res[0]["losses"], out)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", FSDP_SPECS[1:])  # none's exact fp32 ratio: the accelerate test above checks it
def test_lightning_model_parallel_strategy_compresses_in_configure_model(spec, tmp_path):
    pytest.importorskip("lightning", reason="needs `pip install gradzip[lightning]`")
    out = tmp_path / "l"
    p = subprocess.run([sys.executable, str(EXAMPLES / "lightning_fsdp.py"), "--compressor", spec, "--steps", "12",
                        "--out", str(out)], env=_env(), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    (metrics,) = out.glob("lightning_logs/version_*/metrics.csv")
    header, *rows = [line.split(",") for line in metrics.read_text().splitlines()]
    col = {name: i for i, name in enumerate(header)}
    sent = [float(r[col["gradzip/bytes_per_step"]]) for r in rows if r[col["gradzip/bytes_per_step"]]]
    assert len(sent) == 12 and min(sent) > 0
    ratios = [float(r[col["gradzip/compression_ratio"]]) for r in rows if r[col["gradzip/compression_ratio"]]]
    losses = [float(r[col["loss"]]) for r in rows if r[col["loss"]]]
    fsdp_figures_hold(spec, ratios, losses, out)


# ---------------------------------------------------------------------- the hook binds late
def test_ddp_hook_state_built_before_the_process_group_binds_at_the_first_step(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip

    assert not dist.is_initialized()
    state, hook = gradzip.ddp_hook("topk:ratio=0.1,ef=true", min_compress_numel=8)
    assert state.comm is None and state.stats() == {}
    state.load_state_dict(state.state_dict())  # a checkpoint may come back before binding
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 2))
        ddp = DDP(model)
        ddp.register_comm_hook(state, hook)
        ddp(torch.randn(4, 16)).sum().backward()
        assert state.comm is not None and state.comm.world_size == 1
        assert state.stats()["steps"] == 1
        assert state.state_dict()["compressor"]["memory"]  # the error memory lives on
    finally:
        state.close()
        dist.destroy_process_group()


def test_lightning_checkpoint_round_trips_the_hook_state():
    """on_save_checkpoint puts every rank's state in the checkpoint dict; on_load_checkpoint gives
    each rank its own back (here one process: rank 0), through torch.save/load(weights_only)."""
    pytest.importorskip("lightning", reason="needs `pip install gradzip[lightning]`")
    import io

    from gradzip.engine.ddp import GradzipHookState
    from gradzip.errors import GradzipError
    from gradzip.integrations.lightning import GradzipCallback

    state = GradzipHookState("topk:ratio=0.5,ef=true")
    state.compressor.set_residuals("bucket0", [torch.randn(6), torch.randn(2, 3)])
    ckpt: dict = {}
    GradzipCallback(state).on_save_checkpoint(None, None, ckpt)
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    fresh = GradzipHookState("topk:ratio=0.5,ef=true")
    GradzipCallback(fresh).on_load_checkpoint(None, None, loaded)
    for a, b in zip(state.compressor.residuals("bucket0"), fresh.compressor.residuals("bucket0")):
        assert torch.equal(a, b)
    with pytest.raises(GradzipError, match="hook state is for compressor"):
        GradzipCallback(GradzipHookState("onebit")).on_load_checkpoint(None, None, loaded)
    GradzipCallback(GradzipHookState("onebit")).on_load_checkpoint(None, None, {})  # no gradzip entry: nothing
