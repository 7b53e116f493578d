"""``gradzip.fsdp_compress``: compression inside FSDP2 (``fully_shard``) on Gloo.

Two launches: 2 ranks of 1-D FSDP (tests/_fsdp_worker.py ``fsdp``) and 4 ranks of HSDP on a 2x2
mesh (``hsdp``); each rank saves its results for these tests to compare. The references are plain
FSDP2 and native HSDP (run by the same ranks), and, for the compressed paths, step 0's reduced
shard computed here from every rank's local gradient (the data is deterministic).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import _fsdp_worker as W
import pytest
import torch
from torch import nn

import gradzip
from gradzip.comm import spawn_local
from gradzip.compress import create
from gradzip.compress.ef import ErrorFeedback
from gradzip.errors import GradzipError

HERE = Path(__file__).resolve().parent
LAUNCH_TIMEOUT = 120.0


@functools.cache
def _launch(phase: str, n: int, tmp: str) -> dict[int, dict]:
    out = Path(tmp) / f"{phase}{n}"
    out.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    rc = spawn_local("gloo", n, ["--out", str(out), "--phases", phase], env_extra=env, timeout=LAUNCH_TIMEOUT,
                     module="_fsdp_worker", grace=5.0)
    errs = {p.name: p.read_text() for p in out.glob("rank*.err")}
    assert rc == 0 and not errs, f"{phase} x{n} failed (exit {rc}): {errs}"
    results = {r: torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(n)}
    if (lost := out / "rank0.lost.pt").exists():
        results[0]["lost"] = torch.load(lost, weights_only=True)
    return results


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("fsdp"))


def fsdp(tmp: str) -> dict[int, dict]:
    return _launch("fsdp", 2, tmp)


def hsdp(tmp: str) -> dict[int, dict]:
    return _launch("hsdp", 4, tmp)


def same(a: list, b: list) -> bool:
    """Bit-identical lists (of lists) of tensors."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def reference_step0(spec: str, n: int, rank: int) -> list[torch.Tensor]:
    """Step 0's reduced shards of ``rank`` under ``spec``: every rank's local gradient, cut as FSDP
    cuts its reduce-scatter input, each rank's chunk compressed with that rank's fresh compressor
    under gradzip's key, and combined as the compressor combines payloads."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Linear(8, 4))
    local = []
    for i in range(n):
        model.zero_grad()
        W.loss_of(model, W.batch(0, i, False)).backward()
        local.append([[p.grad.clone() for p in layer.parameters()] for layer in model])
    out = []
    for u, layer in enumerate(model):
        sizes = [-(-p.shape[0] // n) for p in layer.parameters()]
        payloads, ctx = [], None
        for i in range(n):
            padded = [torch.cat([g, g.new_zeros(s * n - g.shape[0], *g.shape[1:])]) for g, s in zip(local[i][u], sizes)]
            chunk = torch.cat([g[rank * s:(rank + 1) * s].reshape(-1) for g, s in zip(padded, sizes)])
            payload, c = create(spec).compress_batch([chunk], f"{u}/{rank}")
            payloads.append(payload)
            ctx = c if i == rank else ctx
        comp = create(spec)
        if comp.collective == "allreduce":
            mean = tuple(torch.stack([p[k] for p in payloads]).sum(0).div_(n) for k in range(len(payloads[0])))
            flat = comp.decompress_batch(mean, ctx)[0]
        else:
            flat = comp.aggregate([comp.decompress_batch(p, ctx)[0].clone() for p in payloads])
        offset = 0
        for p, s in zip(layer.parameters(), sizes):
            k = s * p[0].numel()
            out.append(flat[offset:offset + k].view(s, *p.shape[1:])[:max(0, min(s, p.shape[0] - rank * s))])
            offset += k
    return out


# -- in-process: bad input, the low-precision memory ------------------------------------------
def test_export_is_lazy() -> None:
    assert gradzip.fsdp_compress.__module__ == "gradzip.engine.fsdp"


@pytest.mark.parametrize(("spec", "model", "kw", "words"), [
    ("none", nn.Linear(2, 2), {}, "no FSDP module"),
    ("nosuch", nn.Linear(2, 2), {}, "unknown compressor 'nosuch'"),
    ("topk:ratio=0.1,ef=true", nn.Linear(2, 2), {"ef_dtype": torch.int8}, "ef_dtype must be"),
    ("none", "model", {}, "must be an nn.Module"),
    ("onebit:ef=false", nn.Linear(2, 2), {"ef_dtype": torch.bfloat16}, "keeps no error memory"),
])
def test_bad_input_is_one_line(spec: str, model: object, kw: dict, words: str) -> None:
    with pytest.raises(GradzipError, match=words) as e:
        gradzip.fsdp_compress(model, spec, **kw)
    assert "\n" not in str(e.value)


def test_low_precision_memory_keeps_the_residual() -> None:
    """compensated == transmitted + memory, up to the memory's rounding; half of fp32's bytes."""
    ef = ErrorFeedback(create("topk:ratio=0.25"), memory_dtype=torch.bfloat16)
    g = torch.randn(64, generator=torch.Generator().manual_seed(1))
    payload, ctx = ef.compress_batch([g], "k")
    sent = ef.decompress_batch(payload, ctx)[0]
    mem = ef.residuals("k")[0]
    assert mem.dtype == torch.bfloat16 and mem.numel() == 64
    torch.testing.assert_close(sent + mem.float(), g, atol=1e-2, rtol=1e-2)
    payload2, ctx2 = ef.compress_batch([g], "k")  # the memory comes back in the next step
    assert not torch.equal(ef.decompress_batch(payload2, ctx2)[0], sent)
    ef.load_state_dict(ef.state_dict())
    assert torch.equal(ef.residuals("k")[0], mem)


# -- 1-D FSDP, 2 ranks ----------------------------------------------------------------------


@pytest.mark.parametrize("integer", [True, False])
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_none_is_bit_identical_to_plain_fsdp2(tmp_root: str, integer: bool) -> None:
    for res in fsdp(tmp_root).values():
        run = res[f"none_{integer}"]
        assert same(run["gz"], run["plain"])
        # an fp32 alltoall of each module's reduce-scatter input per step: (n-1)/n of it
        assert run["bytes"] == 3 * (48 + 36) * 4 // 2
        assert run["stats"] == {"alltoall": {"calls": 6, "bytes": run["bytes"]}}


@pytest.mark.parametrize(("spec", "tol"), [("fp16", 2e-3), ("bf16", 1e-2)])
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_casts_are_close_to_plain_and_send_half(tmp_root: str, spec: str, tol: float) -> None:
    for res in fsdp(tmp_root).values():
        for got, want in zip(res[spec]["grads"], res["plain"]):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=tol, rtol=tol)
        assert res[spec]["bytes"] == 3 * (48 + 36) * 2 // 2


@pytest.mark.parametrize("spec", ["onebit", "topk:ratio=0.25,ef=true", "randomk:ratio=0.5"])
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_compressed_shards_match_the_reference(tmp_root: str, spec: str) -> None:
    """Step 0 exactly as the chunked alltoall defines it; bytes from the compressor's payload size."""
    results = fsdp(tmp_root)
    for r, res in results.items():
        assert same(res[spec]["grads"][0], reference_step0(spec, 2, r)), f"rank {r}"
        c = create(spec)
        per_step = sum(2 * c.payload_bytes(numel // 2) // 2 for numel in (48, 36))
        assert res[spec]["bytes"] == 3 * per_step
        assert res[spec]["stats"]["alltoall"]["calls"] == 6


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_compressors_that_are_not_chunkable_run_their_own_exchange(tmp_root: str) -> None:
    """PowerSGD (two rounds, per matrix) at full rank on each parameter's shard: the plain gradient,
    through two allreduces (P, Q) per module; threshold (data-dependent sizes): its allgather, finite."""
    for res in fsdp(tmp_root).values():
        ps = res["powersgd:rank=4,min_compression_rate=0"]
        for got, want in zip(ps["grads"], res["plain"]):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        assert set(ps["stats"]) == {"allreduce"} and ps["stats"]["allreduce"]["calls"] >= 2 * 2 * 3
        th = res["threshold:ef=true"]
        assert "allgather" in th["stats"] and all(torch.isfinite(g).all() for step in th["grads"] for g in step)
        assert th["state"]["compressor"]["memory"]  # error memory, keyed per module


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_gradient_divide_factor_is_honoured(tmp_root: str) -> None:
    """``set_gradient_divide_factor(8)``: the sum over 2 ranks over 8, a quarter of the mean."""
    for res in fsdp(tmp_root).values():
        assert same(res["divide"], [[g / 4 for g in step] for step in res["divide_plain"]])


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_a_lost_rank_is_named_within_the_timeout(tmp_root: str) -> None:
    lost = fsdp(tmp_root)[0]["lost"]
    assert lost["msg"].startswith("CommError: alltoall"), lost["msg"]
    assert "lost global rank(s) [1]" in lost["msg"]
    assert lost["s"] < 3.0 + 2.0 + 5.0


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_error_memory_is_the_reduce_scatter_input(tmp_root: str) -> None:
    for res in fsdp(tmp_root).values():
        mem = res["topk:ratio=0.25,ef=true"]["state"]["compressor"]["memory"]
        assert sorted(mem) == ["0/0", "0/1", "1/0", "1/1"]
        assert sum(t.numel() for v in mem.values() for t in v) == 48 + 36
        assert res["topk:ratio=0.25,ef=true"]["state"]["mesh"] == [2, 1]


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_accumulation_exchanges_once_per_step(tmp_root: str) -> None:
    for res in fsdp(tmp_root).values():
        assert res["accum_calls"] == 2 * 2  # 2 steps x 2 FSDP modules with parameters, 3 micro-batches each


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_resume_is_bit_identical_and_other_meshes_need_reset(tmp_root: str) -> None:
    for res in fsdp(tmp_root).values():
        rs = res["resume"]
        assert same(rs["again"], rs["first"])
        assert "[4, 1]" in rs["mismatch"] and "[2, 1]" in rs["mismatch"] and "reset_error=True" in rs["mismatch"]
        assert "\n" not in rs["mismatch"]
        assert rs["reset_memory"] == 0


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_bf16_error_memory_halves_it(tmp_root: str) -> None:
    for res in fsdp(tmp_root).values():
        runs = res["ef_dtype"]
        assert runs["None"]["mem_bytes"] == 4 * (48 + 36)
        assert runs["torch.bfloat16"]["mem_bytes"] == 2 * (48 + 36)
        for got, want in zip(runs["torch.bfloat16"]["grads"], runs["None"]["grads"]):
            for g, w in zip(got, want):
                assert torch.isfinite(g).all()
                torch.testing.assert_close(g, w, atol=0.2, rtol=0.2)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_remove_restores_fsdp(tmp_root: str) -> None:
    for res in fsdp(tmp_root).values():
        assert same(res["removed"]["grads"], res["removed"]["plain"])
        assert res["removed"]["bytes"] == 0


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_bad_input_across_ranks(tmp_root: str) -> None:
    for res in fsdp(tmp_root).values():
        assert "replicate must be a ProcessGroup or a 1-D DeviceMesh, got str" in res["bad"]["replicate"]
        assert "unknown compressor 'nosuch'" in res["bad"]["spec"]
        assert "compressor spec differs on rank(s) [1]" in res["bad"]["mismatch"]
        assert "\n" not in res["bad"]["mismatch"]
        assert "already has gradzip" in res["bad"]["twice"]


# -- HSDP, 4 ranks on a 2x2 mesh ----------------------------------------------------------------
@pytest.mark.parametrize("integer", [True, False])
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_hsdp_none_equals_native_hsdp(tmp_root: str, integer: bool) -> None:
    for res in hsdp(tmp_root).values():
        run = res[f"none_{integer}"]
        assert same(run["gz"], run["native"])
        assert run["bytes"] == 3 * (24 + 18) * 4  # an fp32 allreduce of each shard over 2 replicas


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_hsdp_compressed_replica_allreduce_keeps_memory_per_shard(tmp_root: str) -> None:
    results = hsdp(tmp_root)
    for res in results.values():
        t = res["topk"]
        assert t["shards"] == [24, 18]
        mem = t["state"]["compressor"]["memory"]
        assert {k: sum(m.numel() for m in v) for k, v in mem.items()} == {"0/replica": 24, "1/replica": 18}
        assert t["state"]["mesh"] == [2, 2]
        assert t["stats"]["allgather"]["calls"] == 3 * 2 * 2  # values and indices, 2 modules, 3 steps
        assert all(torch.isfinite(g).all() for step in t["grads"] for g in step)
    for res in results.values():
        assert "overlap the replica group" in res["overlap"] and "\n" not in res["overlap"]
    # replicas of the same shard agree (ranks r and r + 2 hold the same shard)
    for r in (0, 1):
        assert same(results[r]["topk"]["grads"], results[r + 2]["topk"]["grads"])


@pytest.mark.parametrize(("run", "op", "tol"), [("fp16/None", "allreduce", 2e-3),
                                                ("onebit:exchange=twophase/None", "alltoall", None),
                                                ("topk:ratio=0.25,ef=true/torch.bfloat16", "allgather", None),
                                                ("powersgd:rank=4,min_compression_rate=0/None", "allreduce", 1e-4)])
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_hsdp_other_exchanges(tmp_root: str, run: str, op: str, tol: float | None) -> None:
    """The replica exchange takes the compressor's collective or the spec's scheme; fp16 stays
    close to native HSDP, and so does PowerSGD of each parameter's shard at full rank; replicas of
    a shard agree."""
    results = hsdp(tmp_root)
    for res in results.values():
        assert res[run]["stats"][op]["calls"] > 0
        for got, want in zip(res[run]["grads"], res["none_False"]["native"]):
            for g, w in zip(got, want):
                assert torch.isfinite(g).all()
                if tol is not None:
                    torch.testing.assert_close(g, w, atol=tol, rtol=tol)
    if run.startswith("powersgd"):  # two rounds (P, then Q) per module and step: the matrices, not a flat shard
        assert results[0][run]["stats"]["allreduce"]["calls"] > 2 * 2 * 3
    for r in (0, 1):
        assert same(results[r][run]["grads"], results[r + 2][run]["grads"])
