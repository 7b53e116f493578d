"""``python -m gradzip.bench.validate``: option parsing, the measurement and prediction arithmetic
and the table, without root or the testbed (the testbed runs themselves are a manual check)."""

import argparse
import statistics

import pytest

from gradzip.bench import validate as v
from gradzip.bench.validate_table import markdown
from gradzip.cli import main
from gradzip.cluster import simulate as sim
from gradzip.training.metrics import read_metrics

SPARSE = "topk:ratio=0.01,ef=true,exchange=sparse"
TWOPHASE = "onebit:exchange=twophase"


def args(*extra: str) -> argparse.Namespace:
    return v._parse_args(["--hosts", "2", "--rates", "100mbit", *extra])


def rec(step: int, compute: float, compress: float = 0.0, comm: float = 0.0, opt: float = 0.0) -> dict:
    return {"step": step, "compute_s": compute, "opt_s": opt, "compress_s": compress, "comm_s": comm,
            "step_s": compute + opt + compress + comm, "host_s": 0.0}


# ------------------------------------------------------------------ options
def test_syncs_parse_and_default_to_step():
    a = args("--steps", "24", "--warmup", "8", "--syncs", "step", "diloco:every=8", "diloco:every=8,fragments=2")
    assert a.syncs == ["step", "diloco:every=8", "diloco:every=8,fragments=2"]
    assert args().syncs == ["step"] and args().compressors[0] == "none"
    assert [v.period(s) for s in a.syncs] == [1, 8, 8]
    assert v.period("localsgd:every=4") == 4


@pytest.mark.parametrize("extra, why", [
    (["--syncs", "diloco"], "needs every=H"),
    (["--syncs", "dilocoo:every=4"], "unknown --sync mode"),
    (["--syncs", "diloco:every=8", "--steps", "12", "--warmup", "8"], "at least one period of 8"),
    (["--syncs", "diloco:every=4", "--steps", "16", "--calibration-steps", "10", "--warmup", "8"],
     "at least one period of 4"),
])
def test_bad_syncs_exit_2(capsys, extra, why):
    with pytest.raises(SystemExit) as e:
        args(*extra)
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_scheme_is_the_compressor_spec():
    """The scheme travels in the spec: train gets `--compressor SPEC`, predict() the same SPEC."""
    cl = v.cluster(2, "100mbit", args(), 1e-4, 0.0)
    work = sim.Workload("bert-tiny", 10_000, 8, 128)
    assert sim.predict(SPARSE, work, cl).exchange == "sparse"
    assert sim.predict(TWOPHASE, work, cl, sync="diloco:every=4").exchange == "twophase"
    a = args("--compressors", SPARSE, TWOPHASE, "--syncs", "diloco:every=4,fragments=2", "--steps", "12")
    tag = "diloco-every4-fragments2-topk-ratio0.01-eftrue-exchangesparse"
    assert v._tag(1, False, a.syncs[0], a.compressors[0]) == tag
    assert v._tag(2, True, "step", "none") == "k2-hier-none"


# ------------------------------------------------------------------ measurement
def test_window_keeps_whole_periods_after_warmup():
    recs = [rec(s, 0.1) for s in range(1, 24)]
    assert [r["step"] for r in v.window(recs, 4)] == list(range(5, 24))
    assert [r["step"] for r in v.window(recs, 4, 8)] == list(range(8, 24))  # 19 after warm-up -> last 16
    assert [r["step"] for r in v.window(list(reversed(recs)), 8, 8)] == list(range(16, 24))
    with pytest.raises(ValueError, match="fewer than one sync period"):
        v.window(recs[:10], 4, 8)


def test_step_measures_medians():
    recs = [rec(s, 0.1 + 0.01 * s, compress=0.02, comm=0.3) for s in range(1, 12)]
    recs[-1]["step_s"] += 5.0  # one straggler: the median ignores it
    m = v.measure(recs, 4, "step")
    assert m["steps"] == 7
    assert m["compute_s"] == pytest.approx(statistics.median(0.1 + 0.01 * s for s in range(5, 12)))
    assert m["step_s"] == pytest.approx(m["compute_s"] + 0.32)
    assert m["own_s"] == pytest.approx(m["compute_s"] + 0.02) and m["comm_s"] == pytest.approx(0.3)
    assert m["sync_cost_s"] == pytest.approx(0.32)


def test_outer_measures_means_over_whole_periods():
    """DiLoCo every=4: one step in four also syncs; the medians would miss the syncs entirely, the
    means over whole periods charge each once per period."""
    recs = []
    for s in range(1, 15):
        sync = s % 4 == 0
        recs.append(rec(s, 0.2, compress=0.05 if sync else 0.0, comm=0.4 if sync else 0.0))
        recs[-1]["host_s"] = 0.3 * s
    m = v.measure(recs, 2, "diloco:every=4")
    assert m["steps"] == 12  # steps 3..14 (12 of 12 after warm-up)
    assert m["step_s"] == pytest.approx(0.2 + 0.45 / 4)
    assert m["compute_s"] == pytest.approx(0.2) and m["compress_s"] == pytest.approx(0.05 / 4)
    assert m["comm_s"] == pytest.approx(0.1) and m["own_s"] == pytest.approx(0.2 + 0.05 / 4)
    assert m["sync_cost_s"] == pytest.approx(0.45)  # per period of 4 steps
    assert m["host_step_s"] == pytest.approx(0.3)
    m3 = v.measure(recs, 3, "diloco:every=4")  # 11 after warm-up: the first is dropped, 2 whole periods
    assert m3["steps"] == 8 and m3["step_s"] == pytest.approx(m["step_s"])
    assert v.measure(recs, 2, "step")["step_s"] == pytest.approx(0.2)  # what the medians would say


# ------------------------------------------------------------------ prediction
@pytest.mark.parametrize("spec, hosts, k, hier", [
    ("none", 2, 1, False), ("fp16", 2, 1, False), ("topk:ratio=0.01,ef=true", 3, 1, False), (TWOPHASE, 2, 1, False),
    (SPARSE, 3, 1, False), (TWOPHASE, 2, 2, True), ("powersgd:rank=4", 2, 2, True)])
def test_step_codec_charges_the_measured_compression(spec, hosts, k, hier):
    """Whatever the scheme (twophase's server re-encode, gTop-k's merges, hierarchical), predict()
    charges exactly the calibration's compress_s at its rank count."""
    a = args("--ranks-per-node", str(k))
    cl = v.cluster(hosts, "10gbit", a, 1e-4, 1e-5)
    work = sim.Workload("bert-tiny", 10_000, 8, 128, hierarchical=hier)
    codec, mem = v.calibrate_codec(spec, "step", work, cl, 0.037)
    assert mem is None and codec.source == "calibration"
    assert sim.predict(spec, work, cl, codec).compress_s == pytest.approx(0.037)
    assert v.calibrate_codec(spec, "step", work, cl, 0.0) == (sim.CodecCost(), None)


@pytest.mark.parametrize("spec", ["none", "fp16", SPARSE, TWOPHASE])
@pytest.mark.parametrize("sync", ["diloco:every=8", "diloco:every=8,fragments=2"])
def test_outer_codec_charges_the_sync_work_per_period(spec, sync):
    cl = v.cluster(2, "10gbit", args(), 1e-4, 0.0)
    work = sim.Workload("bert-tiny", 10_000, 8, 128)
    codec, mem = v.calibrate_codec(spec, sync, work, cl, 0.004)  # per step: 32 ms per period of 8
    p = sim.predict(spec, work, cl, codec, sync=sync, memory_bps=mem)
    assert codec == sim.CodecCost() and p.compress_s == 0
    assert p.outer_s == pytest.approx(0.004) and p.sync_exposed_s == pytest.approx(8 * (p.step_s - p.compute_s))
    assert p.sync_exposed_s == pytest.approx(0.032 + 8 * p.exposed_comm_s)


@pytest.mark.parametrize("sync", ["step", "diloco:every=8", "diloco:every=8,fragments=2"])
@pytest.mark.parametrize("spec", ["none", "fp16", SPARSE])
def test_predictions_reproduce_a_calibration_that_matches_the_model(sync, spec):
    """A calibration run that measured exactly what the model says: the calibrated and the
    step-calibrated predictions agree, at the calibration rate they equal it, and compare()
    reports zero errors."""
    a = args()
    cl, cal_cl = v.cluster(2, "100mbit", a, 1e-4, 0.0), v.cluster(2, "10gbit", a, 1e-4, 0.0)
    work = sim.Workload("bert-tiny", 8 * 128 / 0.25, 8, 128)
    truth = sim.predict(spec, work, cal_cl, sim.CodecCost(2e-9, 2e-9), sync=sync)
    cal = {"compute_s": 0.25, "compress_s": truth.compress_s, "step_s": truth.step_s}
    p, p_step = v.predictions(spec, sync, False, cal_cl, cal_cl, cal, a)
    assert p.step_s == pytest.approx(truth.step_s) and p_step.step_s == pytest.approx(truth.step_s)
    p, p_step = v.predictions(spec, sync, False, cl, cal_cl, cal, a)
    assert p_step.step_s == pytest.approx(p.step_s)
    h = v.period(sync)
    measured = {"step_s": p.step_s, "own_s": p.compute_s + p.compress_s + p.outer_s, "comm_s": p.exposed_comm_s,
                "sync_cost_s": h * (p.step_s - p.compute_s)}
    errs = v.compare(measured, p, p_step, h)
    for key in ("error", "error_same_run_compute", "error_step_calibrated", "error_sync_cost"):
        assert errs[key] == pytest.approx(0.0, abs=1e-9)
    if sync != "step":  # the outer sync: its link time once per period
        assert p.exposed_comm_s > 0 and p.step_s - p.compute_s < 0.5 * truth.compute_s


def test_step_calibrated_counts_waits_and_compare_arithmetic():
    """A calibration step 50 ms longer than compute + predicted comm: the step-calibrated compute
    is 50 ms longer; compare() divides by the measured step (per period for the sync cost)."""
    a = args()
    cl, cal_cl = v.cluster(2, "100mbit", a, 1e-4, 0.0), v.cluster(2, "10gbit", a, 1e-4, 0.0)
    work = sim.Workload("bert-tiny", 8 * 128 / 0.2, 8, 128)
    base = sim.predict("fp16", work, cal_cl, sync="diloco:every=4")
    cal = {"compute_s": 0.2, "compress_s": 0.0, "step_s": base.step_s + 0.05}
    p, p_step = v.predictions("fp16", "diloco:every=4", False, cl, cal_cl, cal, a)
    assert p_step.compute_s == pytest.approx(0.25) and p_step.step_s == pytest.approx(p.step_s + 0.05)
    measured = {"step_s": 2 * p.step_s, "own_s": p.compute_s, "comm_s": 0.0, "sync_cost_s": 0.1}
    e = v.compare(measured, p, p_step, 4)
    assert e["error"] == pytest.approx(-0.5)
    assert e["error_same_run_compute"] == pytest.approx((p.compute_s + p.exposed_comm_s) / (2 * p.step_s) - 1)
    assert e["predicted_sync_cost_s"] == pytest.approx(4 * (p.step_s - p.compute_s))
    assert e["error_sync_cost"] == pytest.approx(e["predicted_sync_cost_s"] / 0.1 - 1)
    assert v.compare({**measured, "sync_cost_s": 0.0}, p, None, 4)["error_sync_cost"] is None


# ------------------------------------------------------------------ the table
def _row(**kw) -> dict:
    row = {"hosts": 2, "ranks_per_node": 1, "mode": "flat", "sync": "step", "rate": "100mbit", "compressor": "none",
           "measured_step_s": 0.5, "predicted_step_s": 0.55, "error": 0.1, "error_same_run_compute": -0.02,
           "predicted_step_s_step_calibrated": 0.52, "error_step_calibrated": 0.04, "measured_comm_s": 0.2,
           "predicted_comm_s": 0.21, "wire_overhead": 0.01, "wire_frame_overhead": 0.0,
           "measured_sync_cost_s": 0.3, "predicted_sync_cost_s": 0.33, "error_sync_cost": 0.1}
    return {**row, **kw}


def test_markdown_columns_follow_the_rows():
    a = args()
    flat = markdown([_row()], 1e-4, a, 10.0)
    assert "| sync |" not in flat and "hosts × ranks" not in flat and "step-calibrated" in flat
    assert "1 of 1 within 15%" in flat.splitlines()[-1]
    rows = [_row(), _row(sync="diloco:every=8,fragments=2", error=-0.2, error_sync_cost=None),
            _row(ranks_per_node=2, mode="hierarchical", inter_bytes_per_step=1e6)]
    md = markdown(rows, 1e-4, a, 10.0)
    lines = md.splitlines()
    assert "| sync |" in lines[0] and "hosts × ranks" in lines[0] and "sync cost per period" in lines[0]
    assert len({line.count("|") for line in lines[:5]}) == 1  # every row as many cells as the header
    assert "`diloco:every=8,fragments=2`" in lines[3] and "(n/a)" in lines[3] and "1.000 MB" in lines[4]
    assert "2 of 3 within 15%" in md
    assert markdown([], 1e-4, a, 1.0).count("\n") == 2


# ------------------------------------------------------------------ the records of a real run
@pytest.mark.timeout(300)
def test_measure_reads_the_records_of_diloco_training(tmp_path, corpus):
    """The fields measure() reads exist in a DiLoCo run's metrics.jsonl (sim backend): a sync step
    records its compression and exposed link time, the others compute only."""
    out = tmp_path / "run"
    assert main(["train", "--model", "bert-tiny", "--seq-len", "32", "--batch-size", "4", "--workers", "2",
                 "--steps", "10", "--eval-batches", "0", "--checkpoint-every", "0", "--no-progress",
                 "--sync", "diloco:every=4,fragments=2", "--compressor", "fp16", "--corpus", str(corpus),
                 "--out", str(out)]) == 0
    recs = read_metrics(out / "metrics.jsonl")
    m = v.measure(recs, 2, "diloco:every=4,fragments=2")
    assert m["steps"] == 8
    w = v.window(recs, 2, 4)
    assert sum(r["syncs"] for r in w) == 4  # two fragments, two periods
    assert m["step_s"] == pytest.approx((w[-1]["wall_s"] - recs[1]["wall_s"]) / 8)
    assert m["comm_s"] > 0 and m["compress_s"] > 0 and m["sync_cost_s"] > 0
    syncing = [r for r in w if r["syncs"]]
    assert m["comm_s"] == pytest.approx(sum(r["comm_s"] for r in syncing) / 8)
    assert all(r["comm_s"] == 0 and r["compress_s"] == 0 for r in w if not r["syncs"])
