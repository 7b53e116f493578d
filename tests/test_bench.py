"""``gradzip bench compress`` at a tiny size: one row per registered compressor, and the payload bytes
it measures equal every compressor's declared formula. (Speed itself is never asserted.)"""

from __future__ import annotations

import json
import os

import pytest
import torch

from gradzip.cli import build_parser, main
from gradzip.compress import create, registry


def run_json(capsys, *argv: str) -> list[dict]:
    code = main(["bench", "compress", "--json", "--repeat", "1", *argv])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_bench_compress_json_rows_match_payload_formulas(capsys):
    rows = run_json(capsys, "--numel", "4096")
    assert [r["name"] for r in rows] == list(registry())
    for r in rows:
        assert "error" not in r, r
        c = create(r["spec"])  # the row's spec rebuilds the benchmarked compressor
        shapes = r.get("shapes", [[r["numel"]]])
        assert r["numel"] == sum(s[0] * (s[1] if len(s) > 1 else 1) for s in shapes)
        bound = c.batch_payload_bytes(shapes)
        assert r["payload_bytes"] == bound if c.fixed_size else r["payload_bytes"] <= bound, r["name"]
        assert r["compression_ratio"] == pytest.approx(4 * r["numel"] / r["payload_bytes"])
        assert r["ratio_to_memcpy"] == pytest.approx(r["time_s"] / r["memcpy_s"])
        assert ("matmul_s" in r) == (r["name"] == "powersgd")
    by_name = {r["name"]: r for r in rows}
    assert by_name["none"]["payload_bytes"] == 4096 * 4
    assert by_name["none"]["numel"] == 4096
    psgd = by_name["powersgd"]
    assert "rank=4" in psgd["spec"] and "ef=false" in psgd["spec"]
    assert psgd["ratio_to_matmul"] == pytest.approx(psgd["time_s"] / psgd["matmul_s"])


def test_bench_compress_only_and_ef(capsys):
    rows = run_json(capsys, "--numel", "1000", "--only", "powersgd", "none", "--ef")
    assert [r["name"] for r in rows] == ["powersgd", "none"]
    assert all("ef=true" in r["spec"] for r in rows)
    rows = run_json(capsys, "--numel", "1000", "--only", "powersgd:rank=2,residual=reduced", "topk:ratio=0.1", "--ef")
    assert [create(r["spec"]).spec for r in rows] == [create("powersgd:rank=2,residual=reduced,ef=true").spec,
                                                      create("topk:ratio=0.1,ef=true").spec]


@pytest.mark.parametrize("argv, message", [(["--only", "nosuch"], "--compressor: unknown compressor(s) nosuch"),
                                           (["--numel", "0"], "--numel, --repeat and --threads must be >= 1"),
                                           (["--only", "powersgd:rank=0"], "powersgd: rank must be"),
                                           (["--only", "topk:colour=red"], "unknown parameter(s) colour")])
def test_bench_compress_bad_input_is_one_line(capsys, argv, message):
    assert main(["bench", "compress", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_gpu_check_runs_its_checks_on_the_cpu(tmp_path, corpus):
    """The prepared GPU check, in its CPU mode (gloo for NCCL, bf16 for fp16): every check passes,
    the injected NaN step is skipped, and the results land in --out."""
    import subprocess
    import sys
    out = tmp_path / "gpu_check.json"
    p = subprocess.run([sys.executable, "-m", "gradzip.bench.gpu_check", "--device", "cpu", "--only",
                        "collectives,compressors,train", "--corpus", str(corpus), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())["checks"]
    assert set(res) == {"collectives-1", "collectives-2", "compressors", "train-bf16", "train-gloo"}
    assert all(r["ok"] for r in res.values()), res
    assert "skipped steps [4]" in res["train-bf16"]["detail"]
    n = 2 * len(registry())  # every compressor bare and with ef=true
    assert res["compressors"]["detail"] == f"{n}/{n} specs agree"


def test_gpu_check_without_a_gpu_says_so(capsys):
    import torch

    from gradzip.bench.gpu_check import main as gpu_check
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert gpu_check(["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no CUDA device here" in err and "\n" not in err
    assert gpu_check(["--device", "cpu", "--only", "nope"]) == 2


def test_bench_compress_aggregate_rows(capsys):
    assert main(["bench", "compress", "--numel", "20000", "--repeat", "1", "--only", "onebit", "topk", "fp16",
                 "--aggregate", "4", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    for name in ("onebit", "topk"):  # allgather compressors: timed against one decode
        assert rows[name]["ranks"] == 4 and rows[name]["aggregate_s"] > 0 and rows[name]["decode_s"] > 0
    assert "aggregate_s" not in rows["fp16"]  # an allreduce compressor sums on the wire


def test_bench_sync_rows_and_memory(capsys):
    """gradzip bench sync: one row per compressor and outer path; DiLoCo's extra memory is θ_global
    plus the Nesterov buffer (2 × the parameters), plus the error memory with ef=true."""
    assert main(["bench", "sync", "--model", "bert-tiny", "--compressor", "none", "topk:ratio=0.1,ef=true",
                 "--rounds", "1", "--outer", "both", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["compressor"], r["outer"]) for r in rows] == [
        ("none", "fused"), ("none", "step"), ("topk:ratio=0.1,ef=true", "fused"), ("topk:ratio=0.1,ef=true", "step")]
    for r in rows:
        assert r["ratio"] == pytest.approx(r["sync_s"] / r["memcpy_s"]) and r["sync_s"] > 0
        assert r["extra_x_params"] == pytest.approx(2.0 if r["compressor"] == "none" else 3.0, rel=1e-3)


def test_bench_sync_codec_rows(capsys):
    """--codec: a row per codec after the sync rows, its encode and decode each over one memcpy, and
    its payload the codec's exact size over the model's parameter shapes."""
    from gradzip.compress.registry import create
    from gradzip.models import bert_config, parameter_shapes

    assert main(["bench", "sync", "--model", "bert-tiny", "--compressor", "none", "--codec", "sparseloco",
                 "--rounds", "1", "--json"]) == 0
    sync, row = json.loads(capsys.readouterr().out)
    comp = create("sparseloco")
    assert sync["compressor"] == "none" and row["codec"] == comp.spec and row["target"] == 10
    shapes = parameter_shapes(bert_config("bert-tiny")).values()
    assert row["payload_bytes"] == sum(comp.payload_bytes(s) for s in shapes)
    assert row["encode_ratio"] == pytest.approx(row["encode_s"] / row["memcpy_s"]) and row["encode_s"] > 0
    assert row["decode_ratio"] == pytest.approx(row["decode_s"] / row["memcpy_s"]) and row["decode_s"] > 0


def test_bench_compress_threads_report_the_speed_up(capsys):
    before = torch.get_num_threads()
    try:
        rows = run_json(capsys, "--numel", "5000", "--only", "onebit", "topk", "--threads", "2")
        assert torch.get_num_threads() == 2  # restored after each one-thread timing
    finally:
        torch.set_num_threads(before)
    for r in rows:
        assert r["threads"] == 2 and r["speedup_threads"] == pytest.approx(r["time_1thread_s"] / r["time_s"])
    rows = run_json(capsys, "--numel", "5000", "--only", "onebit", "--threads", "1")
    torch.set_num_threads(before)
    assert "speedup_threads" not in rows[0]


@pytest.mark.parametrize("spec, message", [("topk", "--powersgd takes a powersgd spec, got 'topk'"),
                                           ("powersgd:rank=0", "rank must be an integer >= 1")])
def test_bench_engine_refuses_a_bad_powersgd_spec_before_starting(capsys, spec, message):
    assert main(["bench", "engine", "--workers", "2", "--model", "tiny", "--powersgd", spec]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_bench_sync_leaves_the_environment_as_it_found_it(capsys, monkeypatch):
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert main(["bench", "sync", "--model", "bert-tiny", "--compressor", "none", "--rounds", "1", "--json"]) == 0
    assert not any(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))


@pytest.mark.parametrize("ratio", [1.0, 4.0])
def test_bench_engine_sim_overlap_paces_the_link_to_the_asked_ratio(ratio):
    """The sim half of ``bench engine``'s overlap rows: the link is set so that the step's
    allreduces take ``ratio`` x the measured compute, and no schedule beats the first bucket."""
    import argparse

    from gradzip.bench.engine import sim_overlap

    args = argparse.Namespace(model="tiny", seq=16, batch=2, workers=2, overlap_cap_mb=0.5)
    row = sim_overlap(args, ratio)
    assert row["comm_ratio"] == ratio and row["buckets"] > 1
    assert row["link_s"] > 0 and row["step_s"] >= max(row["compute_s"], row["link_s"]) * 0.999
    assert 1.0 <= row["ideal_ratio"] <= row["ratio"] * 1.001


# ------------------------------------------------------------- --compressor, as in train and simulate
def test_bench_compress_takes_compressor_like_train_and_simulate(capsys):
    """``--compressor`` is the flag's name (``--only`` stays, the same list): several after one flag,
    or the flag repeated as in ``gradzip simulate``; both land in one list, in order."""
    one = run_json(capsys, "--numel", "1000", "--compressor", "topk:ratio=0.1", "none", "--ef")
    repeated = run_json(capsys, "--numel", "1000", "--compressor", "topk:ratio=0.1", "--compressor", "none", "--ef")
    alias = run_json(capsys, "--numel", "1000", "--only", "topk:ratio=0.1", "--compressor", "none", "--ef")
    for rows in (one, repeated, alias):
        assert [r["spec"] for r in rows] == ["topk:ratio=0.1,ef=true", "none:ef=true"]


@pytest.mark.parametrize("flag", ["--compressor", "--only"])
@pytest.mark.parametrize("value, message", [
    ("nosuch", "--compressor: unknown compressor(s) nosuch"),
    ("powersgd:rank=0", "--compressor powersgd:rank=0: powersgd: rank must be"),
])
def test_bench_compress_errors_name_the_compressor_flag(capsys, flag, value, message):
    assert main(["bench", "compress", flag, value]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err and "--only" not in err


def test_bench_compress_help_names_compressor(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "compress", "--help"])
    assert "--compressor SPEC" in capsys.readouterr().out


def test_bench_compress_takes_names_in_any_case(capsys):
    """TopK is topk, as everywhere else; the row says the registered spelling."""
    assert main(["bench", "compress", "--compressor", "TopK:Ratio=0.05", "--numel", "4096", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "topk" in out and "TopK" not in out


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_bench_fsdp_rows_and_fp32_bytes(capsys, tmp_path):
    """gradzip bench fsdp: one row per configuration; none's bytes are the fp32 reduce-scatter
    payload: each rank sends (n-1)/n of the padded flat gradient (every parameter's dim 0 padded
    to a multiple of n by FSDP2) per step."""
    import argparse
    import math

    from gradzip.bench.fsdp import build_model

    out = tmp_path / "fsdp.json"
    assert main(["bench", "fsdp", "--workers", "2", "--model", "tiny", "--steps", "2", "--rounds", "1",
                 "--compressor", "fp16", "onebit", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    data = json.loads(out.read_text())
    rows = {r["config"]: r for r in data["rows"]}
    assert list(rows) == ["fsdp2", "none", "fp16", "onebit"] and "overhead: none / fsdp2" in table
    assert data["meta"]["workers"] == 2 and all(r["steps"] == 2 and r["step_s"] > 0 for r in rows.values())
    assert rows["fsdp2"]["ratio"] == 1.0 and "bytes_per_step" not in rows["fsdp2"]
    n = 2
    model = build_model(argparse.Namespace(model="tiny", vocab=2048, seq=64))
    padded = sum(math.ceil(p.shape[0] / n) * n * math.prod(p.shape[1:]) for p in model.parameters())
    assert rows["none"]["bytes_per_step"] == 4 * padded * (n - 1) // n
    assert rows["fp16"]["bytes_ratio"] == pytest.approx(0.5)
    assert rows["onebit"]["bytes_ratio"] < 0.05
    for r in data["rows"]:
        assert r["ratio"] == pytest.approx(r["step_s"] / rows["fsdp2"]["step_s"])


@pytest.mark.parametrize("argv, message", [
    (["--workers", "1"], "--workers must be >= 2"),
    (["--compressor", "nosuch"], "--compressor nosuch:"),
    (["--compressor", "powersgd:rank=0"], "--compressor powersgd:rank=0:"),
])
def test_bench_fsdp_bad_input_is_one_line(capsys, argv, message):
    assert main(["bench", "fsdp", "--model", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_bench_fsdp_sizes_are_named_as_train_flags_with_the_old_names_as_aliases(capsys):
    parse = build_parser().parse_args
    new = parse(["bench", "fsdp", "--batch-size", "2", "--seq-len", "16", "--vocab-size", "64"])
    old = parse(["bench", "fsdp", "--batch", "2", "--seq", "16", "--vocab", "64"])
    assert (new.batch, new.seq, new.vocab) == (old.batch, old.seq, old.vocab) == (2, 16, 64)
    with pytest.raises(SystemExit):
        parse(["bench", "fsdp", "--help"])
    text = capsys.readouterr().out
    assert "--batch-size N, --batch N" in text and "--seq-len N, --seq N" in text and "--vocab-size N" in text
    assert main(["bench", "fsdp", "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1" in capsys.readouterr().err
