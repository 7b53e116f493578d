"""Paired Δ vs none over seeds (gradzip.plots.paired): the t interval and verdict on hand-computed
cases, pairing by seed, the paired columns of results.md/results.csv, the excess-loss column and
the ``delta_ci`` figure."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest
from scipy import stats
from test_plots import assert_image
from test_seeds import write

from gradzip.plots import style
from gradzip.plots.paired import Paired, paired_diffs
from gradzip.plots.paired_figure import VERDICT_STYLE, fig_delta_ci
from gradzip.plots.report import make_report
from gradzip.plots.results import Run, load_runs
from gradzip.plots.table import results_csv, results_markdown

T2 = 4.302652729911275  # t(0.975, 2), from a table
T3 = 3.182446305284263  # t(0.975, 3)


def paired(values: list[float]) -> Paired:
    return Paired(list(enumerate(values)))


def test_within_noise_by_hand():
    p = paired([0.1, 0.2, 0.3])
    assert p.n == 3 and p.mean == pytest.approx(0.2) and p.std == pytest.approx(0.1)
    half = 0.1 * T2 / math.sqrt(3)
    assert half == pytest.approx(0.248413771, abs=1e-9)
    assert p.lo == pytest.approx(0.2 - half, rel=1e-9) and p.hi == pytest.approx(0.2 + half, rel=1e-9)
    assert p.lo == pytest.approx(-0.0484138, abs=1e-7) and p.hi == pytest.approx(0.4484138, abs=1e-7)
    assert p.verdict == "within noise"
    # n=3: t(0.975,2)/√3 = 2.484 ≥ 0.2/0.1 = 2; n=4: t(0.975,3)/√4 = 1.591 < 2
    assert T2 / math.sqrt(3) > 2 > T3 / 2
    assert p.seeds_to_decide() == 4


def test_worse_and_better_by_hand():
    w = paired([1.0, 1.1, 0.9, 1.0])  # mean 1.0, s = √(0.02/3) = 0.0816497
    assert w.mean == pytest.approx(1.0) and w.std == pytest.approx(math.sqrt(0.02 / 3))
    assert w.lo == pytest.approx(1.0 - T3 * math.sqrt(0.02 / 3) / 2, rel=1e-9)
    assert w.lo == pytest.approx(0.8700772, abs=1e-7)
    assert w.verdict == "worse" and w.seeds_to_decide() is None  # decided: nothing to plan
    b = paired([-0.3, -0.2, -0.25])  # mean -0.25, s = 0.05, half-width 4.3027·0.05/√3 = 0.124207
    assert b.hi == pytest.approx(-0.25 + 0.05 * T2 / math.sqrt(3), rel=1e-9)
    assert b.hi == pytest.approx(-0.1257931, abs=1e-7)
    assert b.verdict == "better" and b.seeds_to_decide() is None


def test_too_few_pairs_and_edge_cases():
    one = paired([0.3])
    assert one.n == 1 and one.mean == pytest.approx(0.3)
    assert one.std is None and one.lo is None and one.hi is None
    assert one.verdict == "—" and one.seeds_to_decide() is None
    assert Paired([]).mean is None and Paired([]).verdict == "—"
    same = paired([0.1, 0.1])  # no spread: the interval is the point, and it is above 0
    assert same.lo == same.hi == pytest.approx(0.1) and same.verdict == "worse"
    zero = paired([0.1, -0.1])
    assert zero.verdict == "within noise" and zero.seeds_to_decide() is None  # mean 0: no n decides
    # mean 5e-5, s 1.34e-3: about (1.96 · 26.9)² ≈ 2800 seeds, past the cap of 1000
    assert paired([0.001, -0.0009]).seeds_to_decide() is None


def test_seeds_to_decide_is_the_first_n_that_leaves_zero_out():
    p = paired([0.03, -0.01, 0.02, 0.0])  # mean 0.01, s = √(0.001/3)
    n = p.seeds_to_decide()
    assert n == 16
    half = [stats.t.ppf(0.975, m - 1) * math.sqrt(0.001 / 3) / math.sqrt(m) for m in (15, 16)]
    assert half[0] >= 0.01 > half[1]


def run(compressor: str, seed, loss: float | None, params: dict | None = None) -> Run:
    return Run(Path("."), f"{compressor}-{seed}", {"compressor": compressor, "seed": seed},
               {"final_eval_loss": loss}, [], params or {})


def test_pairing_by_seed():
    a = [run("topk", 3, 2.5), run("topk", 0, 2.0), run("topk", 1, None), run("topk", 2, 2.2),
         run("topk", 9, 2.9)]
    b = [run("none", 2, 2.1), run("none", 0, 1.9), run("none", 1, 1.8), run("none", 3, 2.0)]
    p = paired_diffs(a, b)
    # seed 1: no loss on a's side; seed 9: no none run; seed order, whatever the runs' order
    assert [s for s, _ in p.diffs] == [0, 2, 3]
    assert [d for _, d in p.diffs] == pytest.approx([0.1, 0.1, 0.5])
    # a grid's seed text pairs with a config's number; a run without a seed is left out
    c = [run("x", None, 3.0, {"seed": "0"}), run("x", None, 9.0)]
    assert paired_diffs(c, b).diffs == [(0, pytest.approx(1.1))]
    # another key: from summary.json
    a[1].summary["final_eval_excess_loss"] = 0.4
    b[1].summary["final_eval_excess_loss"] = 0.1
    assert paired_diffs(a, b, key="final_eval_excess_loss").diffs == [(0, pytest.approx(0.3))]


NONE = [3.00, 3.10, 2.95, 3.05]  # the none run's final eval loss per seed
DIFFS = {"topk": [0.10, 0.12, 0.08, 0.11],  # worse
         "fp16": [0.03, -0.01, 0.02, 0.0],  # within noise
         "powersgd": [-0.05, -0.06, -0.04],  # better (3 seeds, plus seed 7 that none did not run)
         "fp8": [0.02]}  # one seed


def paired_sweep(root: Path) -> Path:
    cells = []

    def add(c: str, seed: int, final: float) -> None:
        name = f"compressor={c}__seed={seed}"
        write(root / name, c, seed, final, acc=0.3)
        s = json.loads((root / name / "summary.json").read_text())
        s["final_eval_excess_loss"] = final - 2.9  # what a generated-language tier reports
        (root / name / "summary.json").write_text(json.dumps(s))
        cells.append({"name": name, "params": {"compressor": c, "seed": seed}, "status": "done"})

    for seed, base in enumerate(NONE):
        add("none", seed, base)
    for c, ds in DIFFS.items():
        for seed, d in enumerate(ds):
            add(c, seed, NONE[seed] + d)
    add("powersgd", 7, 2.5)
    spec = {"name": "paired", "grid": {"compressor": ["none", *DIFFS]}, "repeats": {"n": 4, "where": None}}
    (root / "sweep.json").write_text(json.dumps({"spec": spec, "cells": cells}))
    return root


def test_results_table_has_paired_columns(tmp_path):
    col = load_runs(paired_sweep(tmp_path / "sw"))
    md = results_markdown(col)
    header = [c.strip() for c in md.splitlines()[0].split("|")[1:-1]]
    assert header[:11] == ["compressor", "seeds", "final eval loss", "Δ vs none", "Δ per seed", "Δ mean [95% CI]",
                           "verdict", "MLM loss", "excess loss", "MLM acc", "NSP acc"]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in md.splitlines() if line.startswith("| `")}
    assert rows["`none`"][3:7] == ["baseline", "—", "—", "baseline"]
    # topk: mean 0.1025, s = √(8.75e-4/3) = 0.017078, half-width 3.1824·0.017078/2 = 0.027175
    assert rows["`topk`"][4:7] == ["+0.1000, +0.1200, +0.0800, +0.1100", "+0.1025 [+0.0753, +0.1297]", "worse"]
    # fp16: mean 0.01, s = 0.018257, half-width 0.029052; 16 seeds would decide (see above)
    assert rows["`fp16`"][4:7] == ["+0.0300, -0.0100, +0.0200, +0.0000", "+0.0100 [-0.0191, +0.0391]",
                                   "within noise (≈16 seeds to decide)"]
    # powersgd: seed 7 has no none run to pair with; mean -0.05, s 0.01, half-width 0.024841
    assert rows["`powersgd`"][1] == "4"
    assert rows["`powersgd`"][4:7] == ["-0.0500, -0.0600, -0.0400", "-0.0500 [-0.0748, -0.0252]", "better"]
    assert rows["`fp8`"][4:7] == ["+0.0200", "—", "—"]
    # excess loss (final - 2.9) as a Stat: none 0.10, 0.20, 0.05, 0.15 -> 0.125 ± 0.06455
    assert rows["`none`"][8] == "0.125 ± 0.06455"
    assert "95% Student t interval" in md and "worse when the interval lies above 0" in md
    assert "excess loss: the held-out masked-LM loss above the exact optimum" in md

    table = {r["compressor"]: r for r in csv.DictReader(io.StringIO(results_csv(col)))}
    assert "delta_per_seed" not in table["topk"]
    topk = table["topk"]
    s = math.sqrt(8.75e-4 / 3)
    assert float(topk["delta_paired_mean"]) == pytest.approx(0.1025)
    assert float(topk["delta_paired_lo"]) == pytest.approx(0.1025 - T3 * s / 2, rel=1e-9)
    assert float(topk["delta_paired_hi"]) == pytest.approx(0.1025 + T3 * s / 2, rel=1e-9)
    assert topk["delta_paired_n"] == "4" and topk["verdict"] == "worse"
    assert table["fp16"]["verdict"] == "within noise" and table["powersgd"]["verdict"] == "better"
    assert table["powersgd"]["delta_paired_n"] == "3"
    assert table["fp8"]["delta_paired_n"] == "1" and table["fp8"]["delta_paired_lo"] == ""
    assert table["fp8"]["verdict"] == "" and float(table["fp8"]["delta_paired_mean"]) == pytest.approx(0.02)
    assert table["none"]["verdict"] == "baseline" and table["none"]["delta_paired_mean"] == ""
    assert float(table["none"]["final_eval_excess_loss"]) == pytest.approx(0.125)
    assert float(table["none"]["final_eval_excess_loss_std"]) == pytest.approx(0.0645497, abs=1e-7)


def test_delta_ci_figure(tmp_path):
    root = paired_sweep(tmp_path / "sw")
    fig, caption = fig_delta_ci(load_runs(root), style.Palette())
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["topk (n=4)", "fp16 (n=4)", "powersgd (n=3)"]
    assert "Not drawn (fewer than 2 paired seeds): fp8." in caption
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["worse", "better", "within noise"]
    # each configuration's mean marker, coloured by its verdict
    means = [(ln.get_xdata()[0], ln.get_color()) for ln in ax.get_lines() if ln.get_marker() in ("s", "D", "o")]
    assert means[:3] == [(pytest.approx(0.1025), VERDICT_STYLE["worse"][0]),
                         (pytest.approx(0.01), VERDICT_STYLE["within noise"][0]),
                         (pytest.approx(-0.05), VERDICT_STYLE["better"][0])]
    style.save(fig, tmp_path / "out", "x")

    rep = make_report(root)  # drawn by default
    drawn = {d.name: d for d in rep.figures}
    assert "delta_ci" in drawn, rep.skipped
    assert_image(root / "figures" / "delta_ci.png", min_kb=4)
    assert "## delta_ci" in (root / "figures" / "figures.md").read_text()


def test_delta_ci_without_seed_groups_is_left_out_quietly(tmp_path):
    root = tmp_path / "one"
    for c, final in (("none", 7.0), ("fp16", 7.1)):
        write(root / f"compressor={c}", c, 0, final, acc=0.3)
    rep = make_report(root)
    assert "delta_ci" not in {d.name for d in rep.figures} | {n for n, _ in rep.skipped}
    assert "Δ per seed" not in rep.table  # one row per run: no paired columns
    asked = make_report(root, figures=["delta_ci"])  # asked for by name: the reason is given
    assert dict(asked.skipped)["delta_ci"] == "no seed groups with a none baseline of otherwise equal parameters"


def test_downstream_section_pairs_fine_tuning_runs(tmp_path):
    """results.md's downstream section: accuracy with its t interval over the fine-tuning runs, and
    Δ vs none paired by (pretraining seed, fine-tuning seed), higher accuracy read as better."""
    from gradzip.plots.downstream_table import downstream_markdown

    root = tmp_path / "ds"
    accs = {"none": [0.50, 0.52, 0.54], "topk": [0.40, 0.43, 0.43], "fp16": [0.51, 0.50, 0.56]}
    cells = []
    for c, vals in accs.items():
        name = f"compressor={c}"
        write(root / name, c, 0, 7.0, acc=0.3)
        (root / name / "downstream").mkdir()
        (root / name / "downstream" / "summary.json").write_text(json.dumps(
            {"accuracy": sum(vals) / 3, "seeds": [{"seed": s, "accuracy": a} for s, a in enumerate(vals)]}))
        cells.append({"name": name, "params": {"compressor": c}, "status": "done"})
    (root / "sweep.json").write_text(json.dumps({"spec": {"name": "ds", "grid": {"compressor": list(accs)}},
                                                 "cells": cells}))
    md = downstream_markdown(load_runs(root))
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in md.splitlines() if line.startswith("| ") and "configuration" not in line}
    half = 0.02 * T2 / math.sqrt(3)  # none: mean 0.52, s = 0.02
    assert rows["none"][1] == f"0.5200 [{0.52 - half:+.4f}, {0.52 + half:+.4f}]".replace("[+", "[").replace(", +", ", ")
    assert rows["none"][4] == "baseline"
    # topk - none per fine-tuning seed: -0.10, -0.09, -0.11 -> mean -0.10, s 0.01
    assert rows["topk"][2] == "-0.1000, -0.0900, -0.1100"
    h = 0.01 * T2 / math.sqrt(3)
    assert rows["topk"][3] == f"-0.1000 [{-0.1 - h:+.4f}, {-0.1 + h:+.4f}]" and rows["topk"][4] == "worse"
    assert rows["fp16"][4] == "within noise"  # +0.01, -0.02, +0.02
    assert downstream_markdown(load_runs(paired_sweep(tmp_path / "sw"))) == ""
