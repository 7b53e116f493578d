"""``auto``: its spec (gradzip.plan.auto), the per-bucket plan of the cost model (gradzip.cluster.auto)
and ``gradzip simulate --compressor auto``."""

from __future__ import annotations

import json

import pytest

from gradzip.cli import main
from gradzip.cluster.auto import TIE, plan
from gradzip.cluster.network import Cluster, CodecCost
from gradzip.cluster.simulate import Workload, predict
from gradzip.errors import SpecError
from gradzip.plan.auto import DEFAULT_CANDIDATES, AutoSpec, is_auto, parse_auto


def test_spec_round_trips_and_names_its_candidates():
    a = parse_auto("auto:candidates=none/fp16/powersgd:rank=4/topk:ratio=0.01+ef=true,floor=powersgd:rank=4,"
                   "tolerance=0.2,replan_every=50")
    assert a.candidates == ("none", "fp16", "powersgd:rank=4", "topk:ratio=0.01,ef=true")
    assert a.allowed == ("none", "fp16", "powersgd:rank=4") and a.tolerance == 0.2 and a.replan_every == 50
    assert parse_auto(a.spec) == a and is_auto(a.spec) and not is_auto("autotune")
    assert parse_auto("auto") == AutoSpec() and set(DEFAULT_CANDIDATES) >= {
        "none", "fp16", "powersgd:rank=4", "topk:ratio=0.01,ef=true", "onebit"}


@pytest.mark.parametrize(("spec", "words"), [
    ("auto:candidates=none/nosuch", "candidate 'nosuch'"),
    ("auto:floor=onebit:ef=true", "floor 'onebit:ef=true' is not one of the candidates"),
    ("auto:candidates=none/none", "listed twice"),
    ("auto:candidates=/", "candidates is empty"),
    ("auto:bogus=1", "unknown option 'bogus'"),
    ("auto:tolerance=-1", "tolerance > 0"),
    ("auto:candidates=none/auto", "cannot be auto"),
])
def test_bad_specs_are_one_line(spec, words):
    with pytest.raises(SpecError, match=words) as e:
        parse_auto(spec)
    assert "\n" not in str(e.value)


def work(model: str = "bert-large") -> Workload:
    return Workload(model, 5600.0, 32, 128)


def cluster(bps: float, nodes: int = 4, g: int = 1) -> Cluster:
    return Cluster(nodes, g, bps, 100e9, 50e-6, 5e-6, "ring")


@pytest.mark.parametrize("bps", [100e6, 1e9, 10e9, 100e9])
def test_plan_is_never_slower_than_the_best_single_candidate(bps):
    p = plan(AutoSpec(), work(), cluster(bps))
    assert p.step_s <= min(p.fixed.values()) * (1 + TIE)
    assert set(p.fixed) == set(DEFAULT_CANDIDATES) and len(p.choice) == len(p.numels)
    assert p.choice[0] == "none"  # the small tensors' bucket goes uncompressed, as in the engine


def test_slow_links_compress_and_a_free_link_does_not():
    slow = plan(AutoSpec(), work(), cluster(100e6))
    assert not slow.none_is_best and slow.fixed["none"] > 10 * slow.step_s
    codecs = {c: CodecCost(1e-8, 0.0) for c in DEFAULT_CANDIDATES if c != "none"}
    free = plan(AutoSpec(), work("bert-tiny"), Cluster(4, 1, 1e16, 1e16, 0.0, 0.0, "ring"), codecs)
    assert free.none_is_best and free.step_s == pytest.approx(free.fixed["none"])


def test_floor_bounds_the_choice():
    p = plan(parse_auto("auto:floor=fp16"), work(), cluster(100e6))
    assert set(p.choice) <= {"none", "fp16"} and set(p.fixed) == {"none", "fp16"}


def test_the_plan_matches_a_fixed_candidate_where_it_picks_it_everywhere():
    # 100 Mbit/s: PowerSGD for every compressed bucket; the plan's step is then that candidate's prediction
    p = plan(AutoSpec(), work(), cluster(100e6))
    if set(p.choice[1:]) == {"powersgd:rank=4"}:
        assert p.step_s == pytest.approx(predict("powersgd:rank=4", work(), cluster(100e6)).step_s, rel=1e-6)


TWOPHASE = "twophase keeps server memory per rank, which cannot follow a bucket to another compressor"
SIM = ["simulate", "--model", "bert-large", "--nodes", "4", "--gpus-per-node", "1", "--tokens-per-second", "5600"]


def test_simulate_prints_the_plan_beside_each_candidate(capsys):
    assert main([*SIM, "--inter-bandwidth", "1gbit", "--compressor", "auto"]) == 0
    out = capsys.readouterr().out
    assert "plan per bucket" in out and "each candidate alone" in out and "powersgd:rank=4" in out
    assert main([*SIM, "--inter-bandwidth", "1gbit", "--compressor", "auto:floor=fp16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["auto"][0]
    assert set(doc["choice"]) <= {"none", "fp16"} and doc["step_s"] <= min(doc["fixed_step_s"].values()) * 1.001


@pytest.mark.parametrize(("extra", "words"), [
    (["--compressor", "auto:candidates=none/nosuch"], "candidate 'nosuch'"),
    (["--compressor", "auto", "--fsdp"], "drop --fsdp/--hsdp/--sync"),
    (["--compressor", "auto", "--sync", "diloco:every=8"], "drop --fsdp/--hsdp/--sync"),
    (["--compressor", "auto:candidates=none/onebit:exchange=twophase"], TWOPHASE),
])
def test_simulate_bad_auto_is_one_line(extra, words, capsys):
    assert main([*SIM, *extra]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


@pytest.mark.parametrize("spec", ["auto:candidates=none/onebit:exchange=twophase",
                                  "auto:candidates=fp16/topk:ratio=0.01+ef=true+exchange=twophase"])
def test_twophase_candidates_are_refused_by_simulate_and_train_alike(spec, tmp_path, capsys):
    """The refusal of gradzip train (the engine's wording), now also gradzip simulate's: one line each."""
    with pytest.raises(SpecError, match="twophase keeps server memory per rank"):
        parse_auto(spec)
    assert main([*SIM, "--compressor", spec]) == 2
    sim_err = capsys.readouterr().err
    out = tmp_path / "run"
    assert main(["train", "--compressor", spec, "--steps", "1", "--out", str(out)]) == 2
    train_err = capsys.readouterr().err
    assert not out.exists()
    for err in (sim_err, train_err):
        assert err.count("\n") == 1 and f"{TWOPHASE}; use its own collective (drop exchange=twophase)" in err
    assert sim_err.split("error: ", 1)[1] == train_err.split("error: --compressor: ", 1)[1]
