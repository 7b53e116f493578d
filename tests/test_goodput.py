"""The goodput model (gradzip.cluster.goodput) against a Monte-Carlo simulation of the same round
process, its closed forms in the limits, and ``gradzip simulate``'s failure flags."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gradzip.cli import main
from gradzip.cluster import goodput as gp
from gradzip.errors import GradzipError


# ------------------------------------------------------------------------------ Monte Carlo
def monte_carlo(n: int, m: int, round_s: float, mtbf_s: float, absent_s: float, *, clusters: int = 2000,
                rounds: int = 400, burn_in: int = 60, seed: int = 0) -> dict[str, float]:
    """The process of the module docstring, simulated directly: ``clusters`` independent clusters
    of ``n`` replicas for ``rounds`` rounds (the first ``burn_in`` dropped, so that the start with
    every replica live does not count). A live replica draws its time to failure from the
    exponential afresh each round (memoryless), fails if it falls inside the round, and is back
    at the first round start at or after failure time + ``absent_s``."""
    rng = np.random.default_rng(seed)
    down = np.zeros((clusters, n), dtype=np.int64)  # whole rounds still to miss
    finished, committed, commits, live_starts = 0.0, 0.0, 0, 0
    for r in range(rounds):
        live = down == 0
        down = np.maximum(down - 1, 0)
        u = rng.exponential(mtbf_s, size=(clusters, n))
        fail = live & (u < round_s)
        # failed at u into this round, back at u + A: rounds missed after this one
        missed = np.ceil((u + absent_s) / round_s).astype(np.int64) - 1
        down = np.where(fail, missed, down)
        s = (live & ~fail).sum(axis=1)
        if r >= burn_in:
            ok = s >= m
            finished += s.sum()
            committed += s[ok].sum()
            commits += ok.sum()
            live_starts += live.sum()
    samples = clusters * (rounds - burn_in)
    return {"live": live_starts / (samples * n), "finish": finished / (samples * n),
            "commit": commits / samples, "goodput": committed / (samples * n),
            "participants": committed / commits if commits else 0.0}


@pytest.mark.parametrize("n, m, round_s, mtbf_s, absent_s", [
    (4, 1, 10.0, 60.0, 20.0),     # about one failure a round in the cluster, absent two rounds
    (4, 3, 10.0, 60.0, 25.0),     # a quorum of 3 of 4: many rounds retried
    (8, 4, 30.0, 240.0, 5.0),     # recovery shorter than a round
    (4, 2, 7.0, 40.0, 21.0),      # recovery an exact multiple of the round
    (3, 3, 5.0, 500.0, 0.0),      # every replica needed, no recovery time
])
def test_model_agrees_with_monte_carlo(n, m, round_s, mtbf_s, absent_s):
    g = gp.goodput(n, round_s, gp.Faults(mtbf_s, absent_s, m))
    mc = monte_carlo(n, m, round_s, mtbf_s, absent_s, seed=n * 100 + m)
    assert mc["live"] == pytest.approx(g.live_probability, rel=0.02)
    assert mc["finish"] == pytest.approx(g.finish_probability, rel=0.02)
    assert mc["commit"] == pytest.approx(g.commit_probability, rel=0.03)
    assert mc["goodput"] == pytest.approx(g.goodput, rel=0.03)
    assert mc["participants"] == pytest.approx(g.participants, rel=0.03)
    assert 0 < g.goodput < g.finish_probability <= 1 or m == 1


def test_rounds_absent_against_monte_carlo_of_the_failure_time():
    """E[D] = E[ceil((u + A) / T)] - 1 for u exponential truncated to [0, T]."""
    rng = np.random.default_rng(7)
    for t, mtbf, a in [(10.0, 60.0, 20.0), (10.0, 60.0, 25.0), (10.0, 3.0, 13.0), (10.0, 200.0, 4.0)]:
        u = rng.exponential(mtbf, size=4_000_000)
        u = u[u < t][:400_000]
        assert np.mean(np.ceil((u + a) / t) - 1) == pytest.approx(gp.rounds_absent(t, a, mtbf), abs=2e-3)


# ------------------------------------------------------------------------------ exact cases
def test_no_failures_is_the_fault_free_run():
    g = gp.goodput(4, 12.0, gp.Faults(math.inf, 30.0, 4))
    assert (g.fail_probability, g.commit_probability, g.goodput, g.participation) == (0.0, 1.0, 1.0, 1.0)
    assert g.participants == 4 and g.live_probability == g.finish_probability == 1.0


def test_no_recovery_time_loses_only_the_failed_round():
    """A = 0: a failed replica is back for the next round, so p = 1 - q; with m = 1, goodput = p."""
    t, mtbf = 10.0, 50.0
    g = gp.goodput(5, t, gp.Faults(mtbf, 0.0, 1))
    q = 1 - math.exp(-t / mtbf)
    assert g.rounds_absent == 0.0 and g.fail_probability == pytest.approx(q, rel=1e-15)
    assert g.finish_probability == pytest.approx(1 - q, rel=1e-15)
    assert g.goodput == pytest.approx(1 - q, rel=1e-12)
    assert g.commit_probability == pytest.approx(1 - q**5, rel=1e-12)


def test_closed_forms_of_one_replica_and_of_the_whole_quorum():
    t, mtbf, a = 10.0, 40.0, 15.0
    one = gp.goodput(1, t, gp.Faults(mtbf, a, 1))
    assert one.goodput == pytest.approx(one.finish_probability, rel=1e-15)
    assert one.commit_probability == pytest.approx(one.finish_probability, rel=1e-15) and one.participants == 1.0
    all4 = gp.goodput(4, t, gp.Faults(mtbf, a, 4))
    assert all4.commit_probability == pytest.approx(all4.finish_probability**4, rel=1e-12)
    assert all4.goodput == pytest.approx(all4.finish_probability**4, rel=1e-12) and all4.participation == 1.0
    # E[D] by hand: k = 1, t1 = 2T - A = 5, P(u > 5) for u exp(1/40) on [0, 10]
    lam = 1 / mtbf
    assert all4.rounds_absent == pytest.approx(1 + (math.exp(-5 * lam) - math.exp(-10 * lam))
                                               / (1 - math.exp(-10 * lam)), rel=1e-12)


def test_uniform_limit_of_rounds_absent():
    assert gp.rounds_absent(10.0, 25.0, math.inf) == pytest.approx(2.5)
    assert gp.rounds_absent(10.0, 25.0, 1e12) == pytest.approx(2.5, rel=1e-9)
    assert gp.rounds_absent(10.0, 20.0, math.inf) == 2.0 == gp.rounds_absent(10.0, 20.0, 33.0)


def test_binomial_is_exact_and_scales_to_thousands_of_replicas():
    pmf = gp.binomial_pmf(6, 0.3)
    assert pmf == pytest.approx([math.comb(6, k) * 0.3**k * 0.7 ** (6 - k) for k in range(7)], rel=1e-12)
    assert gp.binomial_pmf(3, 0.0) == [1.0, 0.0, 0.0, 0.0] and gp.binomial_pmf(3, 1.0) == [0.0, 0.0, 0.0, 1.0]
    big = gp.goodput(4096, 60.0, gp.Faults(3600.0 * 24, 300.0, 4000))
    assert sum(gp.binomial_pmf(4096, big.finish_probability)) == pytest.approx(1.0, rel=1e-9)
    assert 0 < big.goodput < big.finish_probability and big.participants >= 4000


def test_goodput_falls_with_the_failure_rate_and_the_quorum():
    by_rate = [gp.goodput(4, 10.0, gp.Faults(mtbf, 20.0, 2)).goodput for mtbf in (1e4, 600.0, 120.0, 30.0)]
    assert by_rate == sorted(by_rate, reverse=True) and by_rate[0] > 0.99
    by_quorum = [gp.goodput(4, 10.0, gp.Faults(120.0, 20.0, m)) for m in (1, 2, 3, 4)]
    assert [g.goodput for g in by_quorum] == sorted((g.goodput for g in by_quorum), reverse=True)
    assert [g.participation for g in by_quorum] == sorted(g.participation for g in by_quorum)


def test_rate_heal_and_bad_values():
    assert gp.mtbf_from_rate(1.0, 4) == 240.0 and gp.mtbf_from_rate(0.0, 4) == math.inf
    assert gp.heal_bytes(1000, True) == 8000 and gp.heal_bytes(1000, False) == 4000
    assert gp.heal_seconds(1e6, 1e8, 0.01) == pytest.approx(0.09)
    with pytest.raises(GradzipError, match="--mtbf must be positive"):
        gp.Faults(0.0)
    with pytest.raises(GradzipError, match="--min-replicas 5 is more than the 4 replicas"):
        gp.goodput(4, 10.0, gp.Faults(60.0, 0.0, 5))
    with pytest.raises(GradzipError, match="--failures-per-minute"):
        gp.mtbf_from_rate(-1.0, 4)


# ------------------------------------------------------------------------------ the command
BASE = ["simulate", "--model", "bert-tiny", "--nodes", "4", "--gpus-per-node", "1", "--tokens-per-second", "5600",
        "--inter-bandwidth", "100mbit", "--compressor", "none", "--compressor", "topk:ratio=0.01,ef=true"]


def test_table_gains_the_columns_only_with_failure_flags(capsys):
    argv = BASE + ["--sync", "step", "--sync", "diloco:every=32"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert "goodput" not in plain and "partic." not in plain
    assert main(argv + ["--failures-per-minute", "1", "--recovery", "20s", "--min-replicas", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == plain.splitlines()[0] and lines[1].startswith(plain.splitlines()[1])
    assert lines[1].split()[-5:] == ["round", "absent", "commit", "partic.", "goodput"]
    assert lines[2].split()[-5:] == ["-"] * 5  # the per-step row: no rounds to model
    # the existing columns of every row are unchanged
    assert [ln.split()[:-5] for ln in lines[2:6]] == [ln.split() for ln in plain.splitlines()[2:6]]
    assert lines[4].split()[-1].endswith("%") and any("goodput" in ln for ln in lines[6:])


def test_json_gains_the_fields_matching_the_model(capsys):
    argv = BASE + ["--sync", "diloco:every=32", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(argv + ["--mtbf", "4min", "--recovery", "20s", "--min-replicas", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    for before, after in zip(plain["results"], out["results"]):
        assert {k: after[k] for k in before} == before  # every existing field unchanged
        t = 32 * after["compute_s"] + after["sync_exposed_s"]
        heal = gp.heal_seconds(gp.heal_bytes(after["params"], True), 100e6, 50e-6)
        want = gp.goodput(4, t, gp.Faults(240.0, 20.0, 2), heal)
        assert after["round_s"] == pytest.approx(t, rel=1e-12) and after["heal_s"] == pytest.approx(heal)
        assert after["goodput"] == pytest.approx(want.goodput, rel=1e-12)
        assert after["participation"] == pytest.approx(want.participation, rel=1e-12)
        assert after["commit_probability"] == pytest.approx(want.commit_probability, rel=1e-12)
        assert after["committed_tokens_per_s"] == pytest.approx(after["tokens_per_s"] * want.goodput, rel=1e-12)
    assert main(BASE + ["--sync", "diloco:every=32", "--failures-per-minute", "0", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["results"][0]
    assert r["goodput"] == 1.0 and r["mtbf_s"] is None


@pytest.mark.parametrize("flags, needle", [
    (["--sync", "diloco:every=8", "--mtbf", "0s"], "--mtbf must be positive"),
    (["--sync", "diloco:every=8", "--mtbf=-60s"], "--mtbf must be positive"),
    (["--sync", "diloco:every=8", "--mtbf", "soon"], "--mtbf: cannot parse"),
    (["--sync", "diloco:every=8", "--failures-per-minute=-1"], "--failures-per-minute must be"),
    (["--sync", "diloco:every=8", "--mtbf", "60s", "--failures-per-minute", "1"], "give one of --mtbf"),
    (["--sync", "diloco:every=8", "--mtbf", "60s", "--min-replicas", "5"], "--min-replicas 5 is more than the 4"),
    (["--sync", "diloco:every=8", "--mtbf", "60s", "--min-replicas", "0"], "--min-replicas must be >= 1"),
    (["--sync", "diloco:every=8", "--recovery", "20s"], "needs a failure rate"),
    (["--mtbf", "60s"], "add --sync diloco:every=H"),
    (["--sync", "step", "--failures-per-minute", "2"], "add --sync diloco:every=H"),
])
def test_bad_failure_flags_exit_2_with_one_line(flags, needle, capsys):
    assert main(BASE + flags) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
