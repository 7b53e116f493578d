"""``gradzip train --fsdp`` and ``--hsdp`` (gradzip.training.sharding, gradzip.engine.fsdp_sync) on Gloo ranks:
the same training as the replicated run, bit-identical resume, the non-finite skip with its error memory
undone, bytes by collective, and the combinations that cannot be honoured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradzip.cli import build_parser, main
from gradzip.errors import GradzipError
from gradzip.models import BertForPreTraining, bert_config
from gradzip.training.cli import config_from_args
from gradzip.training.config import TrainConfig, load_toml
from gradzip.training.metrics import read_metrics
from gradzip.training.sharding import fp32_reduction_bytes, ranks_per_node

TINY = ["--model", "bert-tiny", "--seq-len", "64", "--batch-size", "4", "--eval-batches", "2", "--eval-every", "2",
        "--lr", "2e-3", "--warmup", "2", "--no-progress", "--backend", "gloo"]
SAME = ("loss", "mlm_loss", "nsp_loss", "grad_norm", "eval_loss", "skipped", "tokens")


def launch(out: Path, corpus: Path, *args: str, fault: str | None = None) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "GRADZIP_FAULT"):
        env.pop(k, None)
    if fault:
        env["GRADZIP_FAULT"] = fault
    proc = subprocess.run([sys.executable, "-m", "gradzip", "train", *TINY, "--corpus", str(corpus), *args,
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(out / "metrics.jsonl")


def memory(path: Path) -> dict[str, torch.Tensor]:
    """The error memory in one rank's checkpoint file: key -> flat tensor."""
    own = torch.load(path, weights_only=True)["own"]["engine"]["fsdp"]["compressor"]["memory"]
    return {k: torch.cat([t.reshape(-1) for t in v]) for k, v in own.items()}


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_fsdp_trains_as_ddp_skips_nan_everywhere_and_resumes_bit_identically(tmp_path, corpus):
    """Two ranks, ``none``, a NaN on rank 1 at step 3: FSDP's losses equal the replicated run's (the
    same arithmetic, other reduction orders), step 3 is skipped on both, the run stopped at step 2 and
    resumed equals the one that ran through, and the checkpoint's model is a plain BERT state dict."""
    steps = ["--workers", "2", "--steps", "4", "--checkpoint-every", "2"]
    fault = "nan:step=3,rank=1"
    ddp = launch(tmp_path / "ddp", corpus, *steps, fault=fault)
    full = launch(tmp_path / "full", corpus, "--fsdp", *steps, fault=fault)
    launch(tmp_path / "cut", corpus, "--fsdp", *steps, "--stop-at", "2", fault=fault)
    cut = launch(tmp_path / "cut", corpus, "--fsdp", *steps, "--resume", fault=fault)
    assert [tuple(r.get(k) for k in SAME) for r in cut] == [tuple(r.get(k) for k in SAME) for r in full]
    assert [r["skipped"] for r in full] == [False, False, True, False]
    for f, d in zip(full, ddp):
        assert f["loss"] == pytest.approx(d["loss"], rel=1e-5, abs=1e-6)
        if not f["skipped"]:
            assert f["grad_norm"] == pytest.approx(d["grad_norm"], rel=1e-4)
    # bytes by collective: they add up, and the reduce-scatter is fp32's (padding aside, within 2%)
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    for r in full:
        assert r["bytes_sent"] == r["bytes_allgather"] + r["bytes_reduce_scatter"] + r["bytes_allreduce"]
        assert r["bytes_reduce_scatter"] == pytest.approx(fp32_reduction_bytes(summary["params"], "fsdp", 2, None),
                                                          rel=0.02)
        assert r["bytes_allgather"] > 0 and r["bytes_allreduce"] == 0
    assert summary["sharding"] == "fsdp" and summary["reduce_scatter_bytes_per_step"] > 0
    assert summary["compression_ratio"] == pytest.approx(1.0, rel=0.02)
    assert "bytes_allgather" not in ddp[0]  # replicated runs keep their fields
    # the checkpoint holds the full model: it loads into an unsharded BERT
    shared = torch.load(tmp_path / "full" / "ckpt-00000004.pt", weights_only=True)["shared"]
    vocab = shared["model"]["bert.embeddings.word_embeddings.weight"].shape[0]
    BertForPreTraining(bert_config("bert-tiny", vocab_size=vocab)).load_state_dict(shared["model"])


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_hsdp_compresses_across_nodes_with_memory_per_shard_and_undoes_a_skipped_step(tmp_path, corpus):
    """Four ranks, two nodes of two: top-k with error feedback across the replicas. Only the replica
    all-reduce crosses nodes; each rank's error memory is its shard, no larger; the NaN step changes
    neither the model nor any rank's memory, and the step after it does."""
    out = tmp_path / "hsdp"
    recs = launch(out, corpus, "--workers", "4", "--hsdp", "--ranks-per-node", "2", "--steps", "3",
                  "--compressor", "topk:ratio=0.05,ef=true", "--checkpoint-every", "1", "--keep-checkpoints", "3",
                  fault="nan:step=2,rank=1")
    assert [r["skipped"] for r in recs] == [False, True, False]
    for r in recs:
        assert r["bytes_inter"] == r["bytes_allreduce"] > 0
        assert r["bytes_allreduce"] < r["bytes_reduce_scatter"] / 4  # 5% of the shard, as index+value pairs
    shared = [torch.load(out / f"ckpt-0000000{s}.pt", weights_only=True)["shared"]["model"] for s in (1, 2)]
    assert all(torch.equal(shared[0][k], shared[1][k]) for k in shared[0])
    n_params = sum(v.numel() for v in shared[0].values() if v.dtype.is_floating_point)
    for rank in range(4):
        suffix = "" if rank == 0 else f"-rank{rank}"
        m1, m2, m3 = (memory(out / f"ckpt-0000000{s}{suffix}.pt") for s in (1, 2, 3))
        assert sum(t.numel() for t in m1.values()) <= n_params // 2 + 64  # one shard of two (plus padding)
        assert all(torch.equal(m1[k], m2[k]) for k in m1)
        assert any(not torch.equal(m1[k], m3[k]) for k in m1)


@pytest.mark.parametrize(("kw", "words"), [
    ({"backend": "sim"}, "--fsdp needs --backend gloo or nccl"),
    ({"backend": "mpi"}, "--fsdp needs --backend gloo or nccl"),
    ({"sync": "diloco:every=4"}, "--fsdp takes --sync step"),
    ({"hierarchical": True}, "--fsdp and --hierarchical"),
    ({"optimizer": "lamb"}, "element-wise optimizer"),
    ({"exchange": "allreduce"}, "--exchange allreduce does not apply"),
    ({"sharding": "zero3"}, "sharding must be one of none, fsdp, hsdp"),
    ({"ef_dtype": "bf16"}, "--ef-dtype bf16 sets the flat error memory's dtype, but --compressor none keeps none"),
    ({"ef_dtype": "bf16", "compressor": "powersgd:rank=4"}, "keeps it per matrix"),
    ({"ef_dtype": "bf16", "sharding": "none"}, "--ef-dtype bf16 applies to --fsdp and --hsdp only"),
])
def test_combinations_that_cannot_be_honoured_are_one_line(kw, words):
    base = {"sharding": "fsdp", "backend": "gloo", **kw}
    with pytest.raises(GradzipError, match=words.replace("-", r"\-")) as e:
        TrainConfig.from_dict(base)
    assert "\n" not in str(e.value)


def test_node_size_must_divide_the_world(monkeypatch):
    for var in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(GradzipError, match="--ranks-per-node 3 does not divide the world size 4"):
        ranks_per_node(3, 4)
    with pytest.raises(GradzipError, match="pass --ranks-per-node K"):
        ranks_per_node(None, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ranks_per_node(None, 4) == 2 and ranks_per_node(2, 4) == 2
    # One node replicates across nothing (gradzip simulate --hsdp refuses it too).
    with pytest.raises(GradzipError, match=r"--hsdp replicates across nodes: it needs >= 2 nodes \(got 1: "
                                           r"--ranks-per-node 4 in a world of 4\)"):
        ranks_per_node(4, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(GradzipError, match="got 1: the launcher's 4 ranks per node"):
        ranks_per_node(None, 4)
    with pytest.raises(GradzipError, match="the 4 ranks started here form one"):  # gradzip train's own ranks
        ranks_per_node(None, 4, from_launcher=False)


@pytest.mark.parametrize(("extra", "words"), [
    (["--hsdp"], "--hsdp replicates across nodes: it needs >= 2 nodes, and the 2 ranks started here form one"),
    (["--hsdp", "--ranks-per-node", "2"], "--hsdp replicates across nodes: it needs >= 2 nodes (got 1"),
    (["--fsdp", "--hsdp"], "--fsdp and --hsdp are two layouts of the same model; give one"),
    (["--hsdp", "--fsdp"], "--fsdp and --hsdp are two layouts of the same model; give one"),
])
def test_one_node_and_both_layouts_are_refused_before_any_rank_starts(tmp_path, capsys, extra, words):
    out = tmp_path / "run"
    assert main(["train", "--backend", "gloo", "--workers", "2", *extra, "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err
    assert not out.exists()


def test_config_file_keys_are_the_flag_names(tmp_path, capsys):
    """fsdp = true / hsdp = true in a --config file, as the flags; sharding = "..." (what config.toml
    writes) still works; contradictions are one line."""
    def cfg_of(body: str) -> TrainConfig:
        path = tmp_path / "c.toml"
        path.write_text('backend = "gloo"\n' + body)
        return TrainConfig.from_dict(load_toml(path), source=str(path))

    assert cfg_of("fsdp = true\n").sharding == "fsdp"
    assert cfg_of("hsdp = true\nranks-per-node = 2\n").sharding == "hsdp"
    assert cfg_of('sharding = "hsdp"\nfsdp = false\n').sharding == "hsdp"
    assert cfg_of("fsdp = false\n").sharding == "none"
    assert cfg_of('sharding = "fsdp"\nfsdp = true\n').sharding == "fsdp"
    assert TrainConfig.from_dict({"backend": "gloo", "hsdp": True}).sharding == "hsdp"  # spec tables too
    for body, words in (("fsdp = true\nhsdp = true\n", "fsdp = true and hsdp = true"),
                        ('hsdp = true\nsharding = "fsdp"\n', "hsdp = true contradicts sharding = 'fsdp'"),
                        ('fsdp = false\nsharding = "fsdp"\n', "fsdp = false contradicts sharding = 'fsdp'"),
                        ('fsdp = "yes"\n', "fsdp must be true or false")):
        with pytest.raises(GradzipError, match=words) as e:
            cfg_of(body)
        assert "\n" not in str(e.value) and "c.toml" in str(e.value)
    # Through the command line: the file's layout, and a flag that overrides it.
    path = tmp_path / "run.toml"
    path.write_text('backend = "gloo"\nworkers = 4\nfsdp = true\n')
    args = build_parser().parse_args(["train", "--config", str(path)])
    assert config_from_args(args).sharding == "fsdp"
    args = build_parser().parse_args(["train", "--config", str(path), "--hsdp", "--ranks-per-node", "2"])
    assert config_from_args(args).sharding == "hsdp"


def test_cli_refuses_with_exit_code_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--fsdp", "--out", str(out), "--steps", "1"]) == 2  # sim is the default backend
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--fsdp needs --backend gloo or nccl" in err
    assert not out.exists()
