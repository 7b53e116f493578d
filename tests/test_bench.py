"""``gradzip bench compress`` at a tiny size: one row per registered compressor, and the payload bytes
it measures equal every compressor's declared formula. (Speed itself is never asserted.)"""

from __future__ import annotations

import json

import pytest

from gradzip.cli import main
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


@pytest.mark.parametrize("argv, message", [(["--only", "nosuch"], "unknown compressor(s) nosuch"),
                                           (["--numel", "0"], "--numel, --repeat and --threads must be >= 1")])
def test_bench_compress_bad_input_is_one_line(capsys, argv, message):
    assert main(["bench", "compress", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
