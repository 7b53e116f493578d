"""``--sync sparseloco --hsdp`` (gradzip.engine.sparseloco_hsdp) on a 2x2 Gloo mesh: each rank's error
memory is its shard, and each sync is, to the bit, a hand computation of SparseLoCo on the shards
(tests/_sparseloco_hsdp_worker.py runs the ranks); ``gradzip train`` resumes it bit for bit."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from gradzip.comm import spawn_local
from gradzip.compress.registry import create

HERE = Path(__file__).resolve().parent
CODEC = "sparseloco:chunk=2,k=3"  # the worker's SYNC: every=2, β = 0.9, α = 0.5
BETA, ALPHA = 0.9, 0.5


@functools.cache
def _ranks(tmp: str) -> dict[int, dict]:
    out = Path(tmp)
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    rc = spawn_local("gloo", 4, ["--out", str(out)], env_extra=env, timeout=120.0, module="_sparseloco_hsdp_worker",
                     grace=5.0)
    errs = {p.name: p.read_text() for p in out.glob("rank*.err")}
    assert rc == 0 and not errs, f"exit {rc}: {errs}"
    return {r: torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(4)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict]:
    return _ranks(str(tmp_path_factory.mktemp("slhsdp")))


def test_each_sync_is_sparseloco_on_the_shards_across_the_replicas(ranks):
    """Ranks s and s + 2 hold the same shard on the two nodes. At each sync (steps 2 and 4), on each
    of them: e ← β e + Δ, codes of e on the shard's chunks, e ← e − decode; then θ_global ← θ_global
    − α · scatter-mean of the two replicas' decodes, and every rank continues from θ_global."""
    codec = create(CODEC)
    res = {r: ranks[r]["fp32"] for r in ranks}
    for s in (0, 1):
        pair = (s, s + 2)
        glob = [t.clone() for t in res[s]["start"]]
        assert all(torch.equal(a, b) for a, b in zip(glob, res[s + 2]["start"]))
        memory = {r: [torch.zeros_like(t) for t in glob] for r in pair}
        for step in (1, 3):  # 0-based steps after which a sync runs
            decoded = {}
            for r in pair:
                before = res[r]["before"][step]
                assert not all(torch.equal(a, b) for a, b in zip(before, glob))  # the node trained
                parts = []
                for j, (g, t) in enumerate(zip(glob, before)):
                    e = torch.mul(memory[r][j], BETA).add_(g - t)
                    d = codec.decompress_batch(*codec.compress_batch([e], "t"))[0] if e.numel() else e.clone()
                    memory[r][j] = e - d
                    parts.append(d)
                decoded[r] = parts
            for j, g in enumerate(glob):
                if g.numel():
                    g.add_(codec.aggregate([decoded[r][j] for r in pair]), alpha=-ALPHA)
            for r in pair:
                assert all(torch.equal(a, b) for a, b in zip(res[r]["after"][step], glob)), (r, step)
        for r in pair:
            assert all(torch.equal(a, b) for a, b in zip(res[r]["after"][2], res[r]["before"][2]))


def test_each_rank_keeps_the_memory_of_its_shard(ranks):
    """The memory's elements are the rank's shard's (half the model: K = 2 ranks a node), in fp32 or
    bf16; the sync's bytes across the nodes are the codec's payload of the shard."""
    full = sum(t.numel() for t in ranks[0]["fp32"]["start"]) + sum(t.numel() for t in ranks[1]["fp32"]["start"])
    for res in ranks.values():
        for dtype, run in ((torch.float32, res["fp32"]), (torch.bfloat16, res["bf16"])):
            assert sum(n for n, _ in run["memory"]) == run["shard_numel"] == sum(t.numel() for t in run["start"])
            assert {d for _, d in run["memory"]} == {dtype}
        assert 2 * res["fp32"]["shard_numel"] == full
        sent = res["fp32"]["bytes"]
        assert [s for _, _, s in sent] == [0, 1, 0, 1]
        inter = [b - intra for b, intra, _ in sent]
        assert inter == [0, res["fp32"]["payload"], 0, res["fp32"]["payload"]]  # a ring allgather of 2: one payload


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_gradzip_train_resumes_bit_identically(tmp_path, corpus):
    """``gradzip train --hsdp --ranks-per-node 2 --sync sparseloco`` on 4 Gloo ranks, stopped at step 3
    (between syncs: the nodes differ) and resumed, gives the losses and bytes of the run through."""
    from test_diloco import records

    from gradzip.cli import main

    args = ["--model", "bert-tiny", "--seq-len", "32", "--batch-size", "2", "--workers", "4", "--backend", "gloo",
            "--hsdp", "--ranks-per-node", "2", "--steps", "4", "--eval-every", "4", "--eval-batches", "1",
            "--no-progress", "--dropout", "0", "--corpus", str(corpus), "--sync", "sparseloco:every=2,k=16"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["train", *args, "--out", str(full)]) == 0
    assert main(["train", *args, "--stop-at", "3", "--out", str(part)]) == 0
    assert main(["train", *args, "--resume", "--out", str(part)]) == 0
    keys = ("step", "loss", "grad_norm", "bytes_sent", "bytes_allreduce", "syncs")  # (the stop evaluates too)
    a, b = records(full), records(part)
    assert [tuple(r.get(k) for k in keys) for r in a] == [tuple(r.get(k) for k in keys) for r in b]
    assert a[-1]["eval_loss"] == b[-1]["eval_loss"]
    assert [r["syncs"] for r in a] == [0, 1, 0, 1] and a[1]["bytes_allreduce"] > 0 == a[0]["bytes_allreduce"]
