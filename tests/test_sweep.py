"""Experiment specs and `gradzip sweep` / `gradzip run`: validation, a real 2-cell sweep on `sim`
end to end (figures and table included), skip-on-rerun, resume, and a failing cell that does not
stop the others."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from gradzip.cli import main
from gradzip.errors import SpecError
from gradzip.experiments.run_cli import shipped
from gradzip.experiments.spec import MAX_NAME, cell_name, load_spec
from gradzip.training.config import TrainConfig

# bert-tiny with a small vocabulary, short sequences and a few steps: a cell trains in seconds.
TINY = """
model = "bert-tiny"
backend = "sim"
workers = 2
vocab_size = 512
seq_len = 32
batch_size = 4
steps = 4
eval_every = 2
eval_batches = 2
checkpoint_every = 2
lr = 2e-3
warmup = 1
progress = false
"""


def write_spec(path: Path, body: str) -> Path:
    path.write_text(body, encoding="utf-8")
    return path


# ---------------------------------------------------------------------- validation
@pytest.mark.parametrize("body, message", [
    ("[base]\nstpes = 3\n[grid]\nseed = [0]\n", r"unknown key 'stpes' in \[base\]; did you mean 'steps'\?"),
    ("[base]\nsteps = '3'\n[grid]\nseed = [0]\n", r"steps must be an integer, got '3'"),
    ("[base]\nsteps = 3\n[grid]\n", r"\[grid\] is empty; add at least one axis"),
    ("[base]\nsteps = 3\n", r"no \[grid\] table"),
    ("[grid]\nseed = []\n", r"axis 'seed' is an empty list"),
    ("[grid]\nseed = 0\n", r"axis 'seed' must be a list of values"),
    ("[grid]\nworkers = [1, 'two']\n", r"cell workers=two: workers must be an integer"),
    ("[grid]\ncompressor = ['topk:ratio=2']\n", r"cell compressor=topk-ratio=2: .*ratio"),
    ("[grid]\nsteps = [1]\n[base]\nsteps = 2\n", r"'steps' is set in both \[base\] and \[grid\]"),
    ("[grid]\nseed = [0]\n[base]\nout = 'x'\n", r"\[base\] key 'out' is not allowed"),
    ("colour = 1\n[grid]\nseed = [0]\n", r"unknown key 'colour' in the spec's top level"),
    ("[grid]\nseed = [0]\n[target]\nloss = 'low'\n", r"\[target\] 'loss' must be a number"),
    ("[grid]\nseed = [0]\n[plot]\nfigures = ['pie']\n", r"\[plot\] unknown figure 'pie'"),
    ("[grid]\nmethod = [{compressor = 'none'}, 1]\n", r"axis 'method' value must be a table"),
    ("[grid]\nseed = [0, 0]\n", r"axis 'seed' lists 'seed=0' twice"),
    ("[grid\nseed = [0]\n", r"not valid TOML"),
    ("[base]\ncompressor = 'powersgd'\n[grid]\nexchange = ['allreduce', 'twophase']\n",
     r"cell exchange=twophase: --exchange: powersgd: powersgd does not support exchange 'twophase'"),
])
def test_bad_specs_get_one_line_errors(tmp_path, capsys, body, message):
    spec = write_spec(tmp_path / "bad.toml", body)
    with pytest.raises(SpecError, match=message) as e:
        load_spec(spec)
    assert "\n" not in str(e.value) and str(spec) in str(e.value)
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradzip sweep: error: ") and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing written for a bad spec


def test_cells_are_the_product_with_stable_safe_names(tmp_path):
    spec = load_spec(write_spec(tmp_path / "s.toml", """
[base]
steps = 3
[grid]
compressor = ["none", "topk:ratio=0.01,ef=true"]
bandwidth = ["100mbit", "1gbit"]
method = [{seed = 0}, {label = "acc2", accumulation = 2, seed = 1}]
"""))
    assert len(spec.cells) == 8
    names = [c.name for c in spec.cells]
    assert names[0] == "compressor=none__bandwidth=100mbit__seed=0"
    assert names[-1] == "compressor=topk-ratio=0.01-ef=true__bandwidth=1gbit__method=acc2"
    assert spec.cells[-1].params == {"compressor": "topk:ratio=0.01,ef=true", "bandwidth": "1gbit",
                                     "accumulation": 2, "seed": 1}
    assert spec.cells[-1].config["steps"] == 3
    assert len(set(names)) == 8 and all("/" not in n and ":" not in n and "," not in n for n in names)
    assert names == [c.name for c in load_spec(tmp_path / "s.toml").cells]  # stable
    long = cell_name({"compressor": "powersgd:rank=4,warm_start=true," + "x" * 200})
    assert len(long) <= MAX_NAME and long != cell_name({"compressor": "powersgd:rank=4,warm_start=true," + "y" * 200})


def test_the_exchange_scheme_is_an_axis(tmp_path):
    spec = load_spec(write_spec(tmp_path / "s.toml", """
[base]
steps = 3
hierarchical = true
ranks_per_node = 2
[grid]
compressor = ["onebit", "topk:ratio=0.01,ef=true"]
exchange = ["allgather", "twophase"]
"""))
    assert [c.name for c in spec.cells][:2] == ["compressor=onebit__exchange=allgather",
                                                "compressor=onebit__exchange=twophase"]
    cfg = TrainConfig.from_dict(spec.cells[1].config)
    assert cfg.spec == "onebit:exchange=twophase" and cfg.hierarchical and cfg.ranks_per_node == 2


def test_shipped_specs_are_valid_and_listed(capsys):
    specs = shipped()
    assert "quickstart" in specs and list(specs)[0] == "quickstart"
    for name, path in specs.items():
        spec = load_spec(path)
        assert spec.description and spec.cells, name
    q = load_spec(specs["quickstart"])
    assert [c.params["compressor"] for c in q.cells] == ["none", "fp16", "topk:ratio=0.01,ef=true", "onebit",
                                                          "powersgd:rank=4"]
    assert (q.base["model"], q.base["backend"], q.base["workers"], q.base["bandwidth"]) == \
        ("bert-tiny", "sim", 4, "1gbit")
    assert "corpus" not in q.base  # the default corpus
    assert main(["run", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in specs)
    assert main(["run", "nosuchspec"]) == 2
    assert "no shipped spec named 'nosuchspec'; choose one of: quickstart" in capsys.readouterr().err


# ---------------------------------------------------------------------- real sweeps
def test_sweep_end_to_end_then_skip_on_rerun(tmp_path, corpus, capsys):
    spec = write_spec(tmp_path / "two.toml", f"""
name = "two"
description = "two cells"
[base]
{TINY}
corpus = "{corpus}"
[grid]
compressor = ["none", "topk:ratio=0.1,ef=true"]
[target]
loss = 100.0
""")
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    state = json.loads((out / "sweep.json").read_text())
    assert [c["status"] for c in state["cells"]] == ["done", "done"]
    names = [c["name"] for c in state["cells"]]
    assert names == ["compressor=none", "compressor=topk-ratio=0.1-ef=true"]
    summaries = {n: json.loads((out / n / "summary.json").read_text()) for n in names}
    assert all(s["steps"] == 4 for s in summaries.values())
    assert (out / "spec.toml").read_text() == spec.read_text()

    # The results table (printed and written) holds the summaries' numbers.
    with open(out / "results.csv") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    for n, s in summaries.items():
        assert float(rows[n]["final_eval_loss"]) == pytest.approx(s["final_eval_loss"], rel=1e-12)
        assert float(rows[n]["mb_per_step"]) == pytest.approx(s["bytes_per_step"] / 1e6, rel=1e-12)
        assert rows[n]["steps_to_target"] == "1"  # a target every run reaches at once
    topk = rows[names[1]]
    assert float(topk["compression_ratio"]) == pytest.approx(summaries[names[1]]["compression_ratio"], rel=1e-12)
    assert float(topk["delta_vs_none"]) == pytest.approx(
        summaries[names[1]]["final_eval_loss"] - summaries[names[0]]["final_eval_loss"], abs=1e-12)
    assert "| `topk:ratio=0.1,ef=true` |" in printed and "figure loss_steps: " in printed
    from test_plots import assert_image

    for fig in ("loss_steps", "loss_time", "bytes_per_step", "step_time", "loss_vs_ratio"):
        assert_image(out / "figures" / f"{fig}.png")
    assert "skipped figure scaling" in printed

    # Re-run: nothing is trained again (summary.json untouched), exit code still 0.
    before = {n: os.stat(out / n / "summary.json").st_mtime_ns for n in names}
    assert main(["sweep", str(spec), "--out", str(out), "--no-plot"]) == 0
    assert "already finished, skipped" in capsys.readouterr().out
    assert {n: os.stat(out / n / "summary.json").st_mtime_ns for n in names} == before
    assert [c["status"] for c in json.loads((out / "sweep.json").read_text())["cells"]] == ["skipped"] * 2

    # A changed spec does not silently reuse (or overwrite) the old runs.
    changed = write_spec(tmp_path / "changed.toml", spec.read_text().replace("lr = 2e-3", "lr = 1e-3"))
    assert main(["sweep", str(changed), "--out", str(out), "--no-plot"]) == 1
    assert "holds a run with other settings (--lr 0.001 vs 0.002)" in capsys.readouterr().out
    assert {n: os.stat(out / n / "summary.json").st_mtime_ns for n in names} == before
    assert not any((out / n / "error.txt").exists() for n in names)


def test_failing_cell_does_not_stop_the_others_and_interrupted_cells_resume(tmp_path, corpus, capsys):
    body = f"""
[base]
{TINY}
stop_at = 2
[grid]
corpus = ["{tmp_path / 'missing.txt'}", "{corpus}"]
"""
    spec = write_spec(tmp_path / "f.toml", body)
    out = tmp_path / "sweep"
    # In-process this time (the mode used under torchrun/mpirun); stop_at=2 leaves the good cell
    # interrupted after its step-2 checkpoint.
    assert main(["sweep", str(spec), "--out", str(out), "--in-process", "--no-plot"]) == 1
    printed = capsys.readouterr().out
    cells = json.loads((out / "sweep.json").read_text())["cells"]
    bad, good = cells
    assert bad["status"] == "failed" and "missing.txt" in bad["error"]
    assert good["status"] == "done"
    error = (out / bad["name"] / "error.txt").read_text()
    assert "Traceback" in error and "missing.txt" in error
    assert "1 failed" in printed and "error.txt" in printed
    assert json.loads((out / good["name"] / "summary.json").read_text())["steps"] == 2

    # Without stop_at the good cell resumes from its checkpoint; the bad cell fails again.
    spec.write_text(body.replace("stop_at = 2\n", ""))
    assert main(["sweep", str(spec), "--out", str(out), "--in-process", "--no-plot"]) == 1
    cells = json.loads((out / "sweep.json").read_text())["cells"]
    assert [c["status"] for c in cells] == ["failed", "done"] and cells[1]["resumed"] is True
    metrics = [json.loads(ln) for ln in (out / good["name"] / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    # The failed attempt was moved aside, not deleted.
    assert any((out / "logs" / "stale").glob(bad["name"] + ".*"))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_gloo_cell_is_launched_by_the_runner(tmp_path, corpus):
    # `gradzip train --backend gloo --workers 2` (run by the sweep) starts the two local processes.
    spec = write_spec(tmp_path / "g.toml", f"""
[base]
{TINY.replace('backend = "sim"', 'backend = "gloo"').replace("steps = 4", "steps = 2")}
corpus = "{corpus}"
[grid]
compressor = ["topk:ratio=0.1,ef=true"]
""")
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), "--out", str(out), "--no-plot"]) == 0
    (cell,) = json.loads((out / "sweep.json").read_text())["cells"]
    summary = json.loads((out / cell["name"] / "summary.json").read_text())
    assert (cell["status"], summary["backend"], summary["workers"], summary["clock"]) == ("done", "gloo", 2, "measured")
    assert summary["steps"] == 2 and summary["bytes_per_step"] > 0


def test_run_list_prints_no_warning(capsys):
    """A cell's caveats (e.g. error feedback on an unbiased compressor) belong to running it."""
    from gradzip.cli import main as cli_main

    assert cli_main(["run", "--list"]) == 0
    out, err = capsys.readouterr()
    assert "quickstart" in out and "warning" not in (out + err).lower()


def test_jobs_run_cells_at_once(tmp_path, capsys):
    """--jobs 2: the cells run as child processes at once, each child's output in its log only."""
    spec = write_spec(tmp_path / "three.toml", f"""
name = "three"
description = "two cells at once"
[base]
{TINY.replace('vocab_size = 512', '')}
corpus = "hmm:states=4,words=60"
[grid]
compressor = ["none", "fp16"]
""")
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), "--out", str(out), "--jobs", "2", "--no-plot"]) == 0
    printed = capsys.readouterr()
    state = json.loads((out / "sweep.json").read_text())
    assert [c["status"] for c in state["cells"]] == ["done"] * 2
    assert state["command"].endswith("--jobs 2")
    for c in state["cells"]:
        assert json.loads((out / c["name"] / "summary.json").read_text())["steps"] == 4
        assert "gradzip train: 4 steps" in (out / "logs" / f"{c['name']}.log").read_text()
    assert "gradzip train: 4 steps" not in printed.err + printed.out  # not echoed with several jobs
    assert main(["sweep", str(spec), "--out", str(out), "--jobs", "2", "--in-process"]) == 2
    assert "--jobs runs cells as child processes" in capsys.readouterr().err


def test_dry_run_checks_the_hsdp_node_size_against_the_workers(tmp_path, capsys):
    """--dry-run catches what a cell's launch would refuse: an --hsdp node size that does not divide
    its workers, or that leaves one node; good ones list the cells (gradzip sweep, gradzip run)."""
    base = '[base]\nmodel = "bert-tiny"\nbackend = "gloo"\nworkers = 4\nsharding = "hsdp"\n'
    for k, words in ((3, "--hsdp --ranks-per-node 3 does not divide the world size 4"),
                     (4, "--hsdp replicates across nodes: it needs >= 2 nodes (got 1")):
        spec = write_spec(tmp_path / f"k{k}.toml", base + f"[grid]\nranks_per_node = [2, {k}]\n")
        assert main(["sweep", str(spec), "--dry-run", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and f"ranks_per_node={k}" in err
    assert not (tmp_path / "out").exists()
    spec = write_spec(tmp_path / "good.toml", base + "[grid]\nranks_per_node = [1, 2]\n")
    assert main(["sweep", str(spec), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    assert "2 cells into" in capsys.readouterr().out
    assert main(["run", "repro-fsdp", "--dry-run", "--out", str(tmp_path / "out")]) == 0  # HSDP 2 x 2: fine
