"""Figures against the number of workers (``bytes_workers``, ``throughput_workers``) and a spec's
``[plot.where]``, which draws a figure from some of the runs only.

The sweeps here are synthetic run directories in ``gradzip train``'s format, with the bytes of
each exchange scheme's formula, so every number in a caption is known.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

from gradzip.errors import SpecError
from gradzip.experiments.run_cli import shipped
from gradzip.experiments.spec import load_spec
from gradzip.plots.report import make_report
from gradzip.plots.results import FIGURES, load_runs, matches_where
from gradzip.plots.scale import methods, normalised_samples_per_s, payloads, reference_compute, scheme_of
from gradzip.plots.scale import split_compressor as split

PAYLOAD = {"fp16": 2.0e6, "onebit": 0.2e6}
SMALL = {"fp16": 0.0, "onebit": 0.02e6}  # small tensors, allreduced in full precision beside the payload
FULL = 4.0e6  # fp32 gradient bytes
# label -> (compressor as written, scheme it runs, hierarchical)
METHODS = {
    "fp16": ("fp16", "allreduce", False),
    "onebit-allgather": ("onebit", "allgather", False),
    "onebit-twophase": ("onebit:exchange=twophase", "twophase", False),
    "onebit-twophase-hier": ("onebit:exchange=twophase", "twophase", True),
}


def sent_bytes(comp: str, scheme: str, hier: bool, n: int) -> tuple[float, float]:
    """(bytes per rank, of which across nodes) by the schemes' formulas; hierarchical: 4 per node."""
    payload, small = PAYLOAD[comp.split(":")[0]], SMALL[comp.split(":")[0]]
    nodes, g = (max(1, n // 4), min(n, 4)) if hier else (n, 1)
    shard, ring = payload / g, 2 * (nodes - 1) / nodes
    cross = {"allreduce": ring * shard, "allgather": (nodes - 1) * shard, "twophase": ring * shard}[scheme]
    cross += ring * small / g
    intra = 2 * (g - 1) / g * FULL
    return cross + intra, cross


def write_run(d: Path, label: str, n: int, steps: int = 12, load: float = 1.0, seed: int = 0) -> None:
    """A run directory; ``load`` > 1 stretches the measured phases (compute, compression, optimizer)
    as a busy machine does, and leaves the modelled communication alone."""
    comp, scheme, hier = METHODS[label]
    d.mkdir(parents=True)
    sent, inter = sent_bytes(comp, scheme, hier, n)
    comm = inter * 8 / 1e9
    rows, wall, samples = [], 0.0, 0
    for k in range(1, steps + 1):
        step_s = load * (0.05 + 0.003 + 0.005) + comm
        wall += step_s
        samples += 8 * n
        rows.append({"step": k, "loss": 9.0 - 0.01 * k + 0.02 * (scheme == "twophase"), "samples": samples,
                     "step_s": step_s, "wall_s": wall, "compute_s": 0.05 * load, "compress_s": 0.003 * load,
                     "comm_s": comm, "opt_s": 0.005 * load, "bytes_sent": sent, "bytes_inter": inter,
                     "clock": "modelled"})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "config.toml").write_text(
        f'model = "bert-tiny"\ncompressor = "{comp}"\nbackend = "sim"\nworkers = {n}\nbandwidth = "1gbit"\n'
        f'hierarchical = {"true" if hier else "false"}\nbatch_size = 8\nseq_len = 32\nsteps = {steps}\nseed = {seed}\n'
        + ("ranks_per_node = 4\n" if hier else ""))
    summary = {"final_loss": rows[-1]["loss"], "steps": steps, "samples": samples, "wall_s": wall,
               "bytes_per_step": sent, "inter_bytes_per_step": inter, "clock": "modelled", "compressor": comp,
               "exchange": scheme, "hierarchical": hier, "workers": n}
    (d / "summary.json").write_text(json.dumps(summary))


def write_sweep(root: Path, where: dict | None = None, ns: tuple[int, ...] = (2, 4, 8)) -> Path:
    cells = []
    for n in ns:
        for label, (comp, _, hier) in METHODS.items():
            if hier and n < 4:
                continue
            name = f"case=n{n}-{label}"
            write_run(root / name, label, n)
            params = {"workers": n, "compressor": comp} | ({"hierarchical": True, "ranks_per_node": 4} if hier else {})
            cells.append({"name": name, "params": params, "status": "done"})
    spec = {"name": "synthetic-scale", "grid": {"case": []}, "target": None,
            "plot": {"figures": ["bytes_workers", "throughput_workers", "loss_steps"], "where": where or {}}}
    (root / "sweep.json").write_text(json.dumps({"spec": spec, "cells": cells}))
    return root


def assert_image(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 8 * 1024, path
    img = mpimg.imread(path)
    assert img.ndim == 3 and min(img.shape[:2]) > 100 and float(np.var(img[..., :3])) > 1e-3, path


def captions(figures_md: Path) -> dict[str, str]:
    """Figure name -> caption, from figures.md (the line after the image)."""
    out, lines = {}, figures_md.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("## ") and i + 4 < len(lines) and lines[i + 2].startswith("!["):
            out[line[3:]] = lines[i + 4]
    return out


def test_the_figures_are_registered():
    assert {"bytes_workers", "throughput_workers"} <= set(FIGURES)


def test_methods_split_compressor_scheme_and_hierarchy(tmp_path):
    assert split("topk:ratio=0.01,ef=true,exchange=sparse") == ("topk:ratio=0.01,ef=true", "sparse")
    assert split("onebit:exchange=twophase") == ("onebit", "twophase")
    assert split("fp16") == ("fp16", None)
    col = load_runs(write_sweep(tmp_path / "s"))
    ms = methods(col)
    assert [m.label for m in ms] == ["fp16 · allreduce", "onebit · allgather", "onebit · twophase",
                                     "onebit · twophase · hierarchical (4/node)"]
    assert [len(m.runs) for m in ms] == [3, 3, 3, 2]  # seed, steps and workers never split a line
    assert scheme_of(ms[2].runs[0]) == "twophase"
    # fitted to the allgather runs: the compressed payload plus the small tensors
    assert payloads(ms) == {"onebit": pytest.approx(PAYLOAD["onebit"] + SMALL["onebit"])}


def test_bytes_and_throughput_against_workers_are_drawn(tmp_path):
    rep = make_report(write_sweep(tmp_path / "s"))
    drawn = {d.name: d for d in rep.figures}
    assert set(drawn) == {"bytes_workers", "throughput_workers", "loss_steps"}, rep.skipped
    for d in drawn.values():
        assert_image(next(p for p in d.paths if p.suffix == ".png"))
        assert any(p.suffix == ".pdf" for p in d.paths)
    cap = captions(rep.figures_md)
    b = cap["bytes_workers"]
    # allgather sends n-1 payloads (and allreduces the small tensors): 1× at n=2, (7·0.2 + 1.75·0.02)/0.22
    # = 6.52× at n=8; twophase 2(n-1)/n: 1× → 1.75×.
    assert "onebit · allgather 1× at n=2 → 6.52× at n=8" in b
    assert "onebit · twophase 1× at n=2 → 1.75× at n=8" in b
    assert "Dashed lines: each compressor's payload" in b and "crossing" not in b.split("Left:")[0]
    assert "only what crosses between nodes" in b
    assert "Nothing crosses nodes for every hierarchical method at n=4 (one node)" in b
    t = cap["throughput_workers"]
    assert "At 8 workers:" in t and "Time axis: modelled" in t
    assert "Dashed line: what n workers would reach if communication and compression were free" in t


def test_throughput_is_load_normalised_on_the_sim_clock(tmp_path):
    # The same method at n=4 twice: once on an idle machine, once 3× slower in every measured phase.
    write_run(tmp_path / "idle", "onebit-twophase", 4)
    write_run(tmp_path / "busy", "onebit-twophase", 4, load=3.0, seed=1)
    write_run(tmp_path / "n8", "onebit-twophase", 8)
    col = load_runs(tmp_path)
    idle, busy = (next(r for r in col.runs if r.name == n) for n in ("idle", "busy"))
    assert busy.samples_per_s < 0.5 * idle.samples_per_s  # its own clock counts the load
    ref = reference_compute(col)
    assert list(ref.values()) == [pytest.approx(0.05)]
    assert normalised_samples_per_s(busy, ref) == pytest.approx(normalised_samples_per_s(idle, ref))
    assert normalised_samples_per_s(idle, ref) == pytest.approx(idle.samples_per_s)
    rep = make_report(tmp_path, tmp_path / "report", figures=["throughput_workers"])
    assert [d.name for d in rep.figures] == ["throughput_workers"]
    cap = captions(rep.figures_md)["throughput_workers"]
    assert "Lines: load-normalised" in cap and "ranged 50–150 ms between runs" in cap


def test_one_worker_count_is_skipped_with_the_reason(tmp_path):
    rep = make_report(write_sweep(tmp_path / "s", ns=(8,)))
    assert dict(rep.skipped)["bytes_workers"] == "the runs have only one worker count"
    assert dict(rep.skipped)["throughput_workers"] == "the runs have only one worker count"


def test_plot_where_restricts_one_figure(tmp_path):
    where = {"loss_steps": {"workers": 8, "compressor": ["onebit", "onebit:exchange=twophase"],
                            "hierarchical": False}}
    root = write_sweep(tmp_path / "s", where)
    col = load_runs(root)
    sub = col.select(where["loss_steps"])
    assert sorted(r.name for r in sub.runs) == ["case=n8-onebit-allgather", "case=n8-onebit-twophase"]
    assert col.select(None) is col and len(col.select({"workers": 8.0}).runs) == 4  # numbers compare by value
    cap = captions(make_report(root).figures_md)
    assert cap["loss_steps"].endswith("Drawn from the runs with workers=8 and compressor in {onebit, "
                                      "onebit:exchange=twophase} and hierarchical=false only.")
    assert "Drawn from" not in cap["bytes_workers"]  # the other figures keep every run
    assert "n=2" in cap["bytes_workers"]


def test_plot_where_that_matches_no_run_skips_the_figure(tmp_path):
    rep = make_report(write_sweep(tmp_path / "s", {"loss_steps": {"workers": 64}}))
    assert dict(rep.skipped)["loss_steps"] == "no run matches [plot.where] workers=64"


def test_matches_where_compares_as_written():
    values = {"compressor": "onebit", "workers": 8, "hierarchical": True, "lr": 0.001}
    assert matches_where(values.get, {"compressor": "onebit", "workers": [4, 8], "hierarchical": True})
    assert matches_where(values.get, {"lr": 1e-3, "workers": 8.0})
    assert not matches_where(values.get, {"compressor": "onebit:exchange=twophase"})
    assert not matches_where(values.get, {"hierarchical": "false"})
    assert not matches_where({"numel": 1234567}.get, {"numel": 1234568})  # no rounding of large numbers


SPEC = """
[base]
steps = 2
[grid]
workers = [2, 8]
compressor = ["onebit", "onebit:exchange=twophase"]
"""


@pytest.mark.parametrize("plot, message", [
    ("[plot.where]\nloss_step = { workers = 8 }\n", r"\[plot.where\] unknown figure 'loss_step'; valid: loss_steps"),
    ("[plot.where]\nloss_steps = { wokers = 8 }\n",
     r"unknown key 'wokers' in \[plot.where\] 'loss_steps'; did you mean 'workers'\?"),
    ("[plot.where]\nloss_steps = {}\n", r"\[plot.where\] 'loss_steps' is empty"),
    ("[plot.where]\nloss_steps = 8\n", r"\[plot.where\] 'loss_steps' must be a table of train keys"),
    ("[plot.where]\nloss_steps = { workers = [] }\n", r"key 'workers' is an empty list"),
    ("[plot.where]\nloss_steps = { workers = { n = 8 } }\n",
     r"key 'workers' must be a string, number or boolean, or a list of them, got dict"),
    ("[plot.where]\nloss_steps = { workers = [8, [2]] }\n", r"key 'workers' value must be a string, number"),
    ("[plot.where]\nloss_steps = { out = 'x' }\n", r"unknown key 'out' in \[plot.where\]"),
    ("[plot]\nwhere = 3\n", r"\[plot.where\] must be a table of figure name"),
    ("[plot.where]\nloss_steps = { workers = 4 }\n",
     r"\[plot.where\] loss_steps = \{workers=4\} matches no cell of the grid"),
    ("[plot.where]\nloss_steps = { compressor = 'onebit', hierarchical = true }\n",
     r"\{compressor=onebit and hierarchical=true\} matches no cell"),
])
def test_bad_plot_where_gets_a_one_line_error(tmp_path, plot, message):
    path = tmp_path / "bad.toml"
    path.write_text(SPEC + plot)
    with pytest.raises(SpecError, match=message) as e:
        load_spec(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_plot_where_in_a_spec_is_kept_for_the_plots(tmp_path):
    path = tmp_path / "ok.toml"
    path.write_text(SPEC + "[plot.where]\nloss_steps = { workers = 8, compressor = ['onebit'] }\n")
    spec = load_spec(path)
    assert spec.plot.where == {"loss_steps": {"workers": 8, "compressor": ["onebit"]}}
    assert spec.to_json()["plot"]["where"] == spec.plot.where  # sweep.json carries it to `gradzip plot`


def test_the_shipped_repro_scale_spec():
    spec = load_spec(shipped()["repro-scale"])
    by_n: dict[int, list] = {}
    for c in spec.cells:
        by_n.setdefault(c.config["workers"], []).append(c)
    assert sorted(by_n) == [2, 4, 8, 16, 32]
    assert not any(c.config.get("hierarchical") for c in by_n[2])
    for n in (4, 8, 16, 32):
        hier = [c for c in by_n[n] if c.config.get("hierarchical")]
        assert {c.config["compressor"] for c in hier} >= {"fp16", "onebit:exchange=twophase"}
        assert all(c.config["ranks_per_node"] == 4 for c in hier)
    for where in spec.plot.where.values():
        picked = [c for c in spec.cells if matches_where(lambda k, c=c: c.config.get(k, False), where)]
        assert sorted(c.config["compressor"] for c in picked) == ["onebit", "onebit:exchange=twophase"]
        assert all(c.config["workers"] == 8 and c.config["steps"] >= 200 for c in picked)
    assert math.isclose(spec.base["lr"], 1e-3) and spec.base["bandwidth"] == "1gbit"
