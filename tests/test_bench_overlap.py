"""``gradzip bench overlap``: the per-round arithmetic from a run's metrics, the cells and their
verdict, the sync specs it runs, and its refusals (bad input; no root) as one line, exit 2, with
nothing written. The measurement itself needs root and minutes; docs/reproductions holds one."""

from __future__ import annotations

import json

import pytest

from gradzip.bench.overlap import cells, measure_rounds, sync_spec
from gradzip.cli import main
from gradzip.netem import testbed


def _rows(every: int, rounds: int, step_s: float, comm_s: float, extra_s: float) -> list[dict]:
    """Metrics rows of a run whose steps take ``step_s`` (+ ``comm_s`` waited at each sync step) and
    whose loop adds ``extra_s`` per step; ``host_s`` accumulates them."""
    rows, host = [], 0.0
    for s in range(1, every * rounds + 1):
        comm = comm_s if s % every == 0 else 0.0
        host += step_s + comm + extra_s
        rows.append({"step": s, "host_s": host, "step_s": step_s + comm, "comm_s": comm, "bytes_sent": 8 * s})
    return rows


def test_measure_rounds_leaves_the_warm_up_out_and_splits_compute_from_the_wait():
    got = measure_rounds(_rows(every=4, rounds=3, step_s=0.25, comm_s=0.5, extra_s=0.125), every=4, warmup=1)
    assert [r["round"] for r in got] == [2, 3]
    for r in got:
        assert r["wall_s"] == pytest.approx(4 * 0.375 + 0.5, abs=1e-12) and r["comm_s"] == 0.5
        assert r["compute_s"] == pytest.approx(4 * 0.375, abs=1e-12)  # the loop's own work included
        assert r["step_compute_s"] == pytest.approx(1.0, abs=1e-12)  # rank 0's steps alone
    assert [r["bytes_sent"] for r in got] == [64, 96]


def test_cells_take_compute_and_exchange_from_the_plain_runs_and_judge_the_overlapped_wall():
    def run(overlap: bool, rep: int, wall: float, compute: float, comm: float) -> dict:
        return {"sync": "diloco", "every": 6, "overlap": overlap, "repeat": rep,
                "rounds": [{"wall_s": wall, "compute_s": compute, "comm_s": comm, "step_compute_s": compute / 2}] * 3}

    runs = [run(False, 0, 2.0, 1.0, 0.75), run(True, 0, 1.0, 1.25, 0.0),
            run(False, 1, 2.5, 1.5, 0.5), run(True, 1, 1.25, 1.5, 0.25),
            run(False, 2, 3.0, 2.0, 1.0), run(True, 2, 1.5, 2.0, 0.5)]
    (cell,) = cells(runs)
    assert cell["compute_s"] == 1.5 and cell["exchange_s"] == 0.75  # medians over the repeats
    assert cell["bound_s"] == 1.5 and cell["sum_s"] == 2.25
    assert cell["wall_no_overlap_s"] == 2.5 and cell["wall_overlap_s"] == 1.25
    assert cell["compute_overlap_s"] == 1.5 and cell["wait_overlap_s"] == 0.25 and cell["step_compute_s"] == 0.75
    assert cell["ratio"] == pytest.approx(1.25 / 1.5) and cell["target_met"] and cell["repeats"] == 3
    assert cell["ratio_own"] == pytest.approx(1.25 / 1.5)  # against the overlapped runs' own compute
    assert cell["loop_no_overlap_s"] == 0.75 and cell["loop_overlap_s"] == 0.75  # compute − step compute
    runs[1]["rounds"] = runs[3]["rounds"] = runs[5]["rounds"] = [{"wall_s": 1.75, "compute_s": 1.5, "comm_s": 0.0,
                                                                  "step_compute_s": 1.0}]
    assert not cells(runs)[0]["target_met"]  # 1.75 > 1.1 × 1.5


def test_sync_spec_adds_every_and_overlap():
    assert sync_spec("diloco", 6, False) == "diloco:every=6"
    assert sync_spec("sparseloco:k=8", 2, True) == "sparseloco:k=8,every=2,overlap=1"


@pytest.mark.parametrize("argv, message", [
    (["--every", "0"], "--every must be >= 1"),
    (["--sync", "diloco:every=4"], "leave every= and overlap= out"),
    (["--netem", "1:100mbit"], "at least 2 hosts"),
    (["--figure", "x.pdf"], "--figure must name a .png file"),
])
def test_bad_input_is_one_line(capsys, tmp_path, argv, message):
    assert main(["bench", "overlap", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "o").exists()


def test_without_root_it_refuses_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(testbed, "_effective_caps", lambda: 0)
    assert main(["bench", "overlap", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs root" in err, err
    assert not (tmp_path / "o").exists()


def test_from_json_recomputes_the_cells_and_the_figure_without_the_testbed(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(testbed, "_effective_caps", lambda: 0)  # no root needed
    runs = [{"sync": "diloco", "every": 2, "overlap": ov, "repeat": 0, "rounds": measure_rounds(
        _rows(every=2, rounds=3, step_s=0.25, comm_s=0.0 if ov else 0.75, extra_s=0.0), every=2, warmup=1)}
        for ov in (False, True)]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"netem": "2:100mbit", "runs": runs, "cells": []}))
    assert main(["bench", "overlap", "--from-json", str(path)]) == 0
    (cell,) = json.loads(path.read_text())["cells"]
    assert cell["compute_s"] == 0.5 and cell["exchange_s"] == 0.75 and cell["wall_overlap_s"] == 0.5
    assert cell["ratio"] == pytest.approx(0.5 / 0.75) and cell["ratio_own"] == pytest.approx(0.5 / 0.75)
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    (tmp_path / "bad.json").write_text("{}")
    assert main(["bench", "overlap", "--from-json", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a JSON that `gradzip bench overlap` wrote" in err, err
