"""Fault-tolerant DiLoCo on torchft (``--sync ftdiloco``, docs/fault-tolerance.md): replica groups
as processes on gloo with an in-process Lighthouse; a kill, a rejoin that heals bit-exactly, the
single-member quorum of a fresh replica, a resume from checkpoints, and bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchft")

import torch.multiprocessing as mp  # noqa: E402

from gradzip.cli import main  # noqa: E402
from gradzip.engine import _ft  # noqa: E402
from gradzip.errors import GradzipError  # noqa: E402
from gradzip.training.metrics import read_metrics  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _ft_worker import run_group  # noqa: E402

SPEC = "topk:ratio=0.25,ef=true"
G0, G1 = "gradzip_group_0", "gradzip_group_1"


@pytest.fixture
def lighthouse():
    server = _ft.start_lighthouse(1, heartbeat_timeout_ms=1000)
    yield server.address()
    server.shutdown()


class Groups:
    """Replica-group processes of one test, with their queue; every process is ended on exit."""

    def __init__(self, tmp: Path, lighthouse: str) -> None:
        self.tmp, self.lighthouse = tmp, lighthouse
        # forkserver: every group forks from one process that imported torch and gradzip already
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "gradzip.engine.ftdiloco", "_ft_worker"])
        self.queue = self.ctx.Queue()
        self.procs: list[Any] = []

    def start(self, name: str, **cfg: Any) -> Any:
        cfg = {"lighthouse": self.lighthouse, "groups": 2, "every": 2, "spec": SPEC,
               "log": str(self.tmp / f"{name}.jsonl"), **cfg}
        p = self.ctx.Process(target=run_group, args=(cfg, self.queue), daemon=True)
        p.start()
        self.procs.append(p)
        return p

    def results(self, n: int) -> dict[int, tuple]:
        out = {}
        for _ in range(n):
            group, digest, syncs, step = self.queue.get(timeout=90)
            out[group] = (digest, syncs, step)
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.join(10)


@pytest.fixture
def groups(tmp_path, lighthouse):
    g = Groups(tmp_path, lighthouse)
    yield g
    g.close()


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(cond: Any, what: str, limit: float = 90.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > limit:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_kill_then_rejoin_heals_bit_exactly(groups, tmp_path):
    """Group 1 is killed mid-run: group 0 goes on alone (partial participation, its bytes only).
    A fresh group 1 rejoins: it copies θ_global, the outer state and the step from group 0
    (torchft's checkpoint transport), its digest equals group 0's, and both finish together."""
    resume = tmp_path / "resume"
    groups.start("a", group=0, steps=16, pause_at=7, resume_file=str(resume))
    b = groups.start("b", group=1, steps=16, pause_at=4, resume_file=str(tmp_path / "never"))
    wait_for(lambda: any(r["step"] == 4 and r["committed"] for r in records(tmp_path / "b.jsonl")), "b's sync")
    b.kill()
    wait_for(lambda: any(r["members"] == [G0] and r["committed"] for r in records(tmp_path / "a.jsonl")),
             "a's sync without b")
    groups.start("b2", group=1, steps=16, ready_file=str(tmp_path / "ready"))
    wait_for((tmp_path / "ready").exists, "b2's manager")
    resume.touch()
    res = groups.results(2)
    assert res[0] == res[1] and res[0][2] == 16  # same digest, torchft step and inner step
    a, b2 = records(tmp_path / "a.jsonl"), records(tmp_path / "b2.jsonl")
    alone = [r for r in a if r["members"] == [G0] and r["committed"]]
    assert alone and all(r["participants"] == [G0] and list(r["bytes"]) == [G0] for r in alone)
    assert all(r["weights"][G0] == 16.0 for r in alone)  # 2 inner steps of 8 tokens
    heal = next(r for r in b2 if r["healed"])
    assert heal["committed"] and heal["heals"] == [G1] and heal["participants"] == [G0]
    assert heal["weights"] == {G0: 16.0, G1: 0.0}
    same = next(r for r in a if r["quorum_id"] == heal["quorum_id"] and r["committed"])
    assert same["digest"] == heal["digest"] and same["heals"] == [G1]
    assert not any(r["healed"] for r in a if not r["join"])  # the live group never healed
    assert heal["bytes"] == {G0: 136, G1: 0}  # 17 values + 17 indices; a weight of 0 sends nothing
    assert all(r["bytes"] == {G0: 136, G1: 136} for r in b2 if r["committed"] and not r["healed"])


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_warm_spare_stays_out_of_the_quorum_until_told(groups, tmp_path):
    """A warm spare (``standby=FILE``) is built but its Manager does not start: group 0 keeps
    committing alone (the Lighthouse does not wait for it). Once FILE exists it joins at group 0's
    next sync, heals to its state and both finish with one digest."""
    resume, go = tmp_path / "resume", tmp_path / "go"
    groups.start("a", group=0, groups=1, steps=12, pause_at=8, resume_file=str(resume))
    groups.start("b", group=1, groups=2, steps=12, standby=str(go), ready_file=str(tmp_path / "ready"))
    wait_for(lambda: sum(r["committed"] for r in records(tmp_path / "a.jsonl")) >= 4, "a's syncs alone")
    assert not (tmp_path / "ready").exists() and not (tmp_path / "b.jsonl").exists()
    assert all(r["members"] == [G0] for r in records(tmp_path / "a.jsonl"))
    go.touch()
    wait_for((tmp_path / "ready").exists, "the spare's manager")
    resume.touch()
    res = groups.results(2)
    assert res[0] == res[1] and res[0][2] == 12
    join = next(r for r in records(tmp_path / "b.jsonl") if r["committed"])
    assert join["join"] and join["healed"] and join["step"] == 10 and join["members"] == [G0, G1]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_group(groups: Any, name: str, group: int, **cfg: Any) -> list[Any]:
    """A replica group of two gloo ranks (DDP inside it): its processes, rank 0 first."""
    port = free_port()
    return [groups.start(f"{name}.r{r}", group=group, rank=r, ranks=2, port=port, **cfg) for r in (0, 1)]


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_ddp_inside_a_group_is_exact(groups, tmp_path):
    """Two replica groups of two gloo ranks each: a group's ranks average their gradients at every
    inner step (so they hold one θ_local, the hand computation's), rank 0 exchanges for the group
    (its weight: 2 steps x 8 tokens x 2 ranks) and every rank takes the same outer step. Lossless,
    outer SGD of lr 1: θ_global − (32·Δ₀ + 32·Δ₁)/64 on all four ranks."""
    import torch
    from _ft_worker import _batch

    for g in (0, 1):
        start_group(groups, f"w{g}", g, steps=4, spec="none", outer_lr=1.0, momentum=0.0,
                    probe=str(tmp_path / f"probe{g}"))
    res = groups.results(4)
    assert len({d for d, _, _ in res.values()}) == 1 and {s for _, _, s in res.values()} == {4}
    before = {(g, r): torch.load(tmp_path / f"probe{g}.before.{r}", weights_only=True) for g in (0, 1) for r in (0, 1)}
    after = {(g, r): torch.load(tmp_path / f"probe{g}.after.{r}", weights_only=True) for g in (0, 1) for r in (0, 1)}
    glob = before[0, 0]["global"]
    for g in (0, 1):  # the group's inner steps by hand: SGD(lr 0.05) on the mean of its two ranks' gradients
        torch.manual_seed(0)
        m = torch.nn.Linear(16, 4)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for step in (0, 1):
            grads = []
            for r in (0, 1):
                m.zero_grad()
                x, y = _batch(g + 100 * r, step)
                torch.nn.functional.mse_loss(m(x), y).backward()
                grads.append([p.grad.clone() for p in m.parameters()])
            for p, g0, g1 in zip(m.parameters(), *grads):
                p.grad = (g0 + g1) / 2
            opt.step()
        for r in (0, 1):
            assert before[g, r]["weight"] == 16.0  # this rank's tokens; the header carries the group's 32
            assert all(torch.equal(a, b) for a, b in zip(before[g, r]["local"], m.parameters()))
            assert all(torch.equal(a, b) for a, b in zip(before[g, r]["global"], glob))
    for i, g in enumerate(glob):
        deltas = [(g - before[k, 0]["local"][i]).reshape(-1) for k in (0, 1)]
        want = g.clone().add_(((deltas[0] * 0.5).add_(deltas[1] * 0.5)).view(g.shape), alpha=-1.0)
        assert all(torch.equal(after[k][i], want) for k in after)
    rec = [r for r in records(tmp_path / "w0.r0.jsonl") if r["committed"] and not r["join"]][0]
    assert rec["weights"] == {G0: 32.0, G1: 32.0} and rec["bytes"] == {G0: 68 * 4, G1: 68 * 4}
    assert not (tmp_path / "w0.r1.jsonl").exists()  # the group's record is rank 0's


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_group_of_two_ranks_rejoins_and_heals_on_both(groups, tmp_path):
    """Both ranks of group 1 are killed after a sync; group 0 (two ranks) goes on alone. A new
    group 1 of two ranks joins: each rank heals from the same rank of group 0, and all four ranks
    end bit-identical."""
    resume = tmp_path / "resume"
    start_group(groups, "a", 0, steps=12, pause_at=6, resume_file=str(resume))
    b = start_group(groups, "b", 1, steps=12, pause_at=2, resume_file=str(tmp_path / "never"))
    wait_for(lambda: any(r["step"] == 2 and r["committed"] for r in records(tmp_path / "b.r0.jsonl")), "b's sync")
    for p in b:
        p.kill()
    wait_for(lambda: any(r["members"] == [G0] and r["committed"] for r in records(tmp_path / "a.r0.jsonl")),
             "a's sync without b")
    start_group(groups, "b2", 1, steps=12, ready_file=str(tmp_path / "ready"))
    wait_for((tmp_path / "ready").exists, "b2's managers")
    resume.touch()
    res = groups.results(4)
    assert len({d for d, _, _ in res.values()}) == 1 and {s for _, _, s in res.values()} == {12}
    heal = next(r for r in records(tmp_path / "b2.r0.jsonl") if r["healed"])
    assert heal["committed"] and heal["heals"] == [G1] and heal["participants"] == [G0]
    same = next(r for r in records(tmp_path / "a.r0.jsonl") if r["quorum_id"] == heal["quorum_id"] and r["committed"])
    assert same["digest"] == heal["digest"]


# Streaming DiLoCo (2 fragments: the weight, then the bias) and SparseLoCo (chunks of 4x4, 2 per chunk)
VARIANTS: dict[str, dict[str, Any]] = {
    "fragments": {"every": 4, "fragments": 2},
    "sparseloco": {"every": 2, "sparseloco": {"chunk": 4, "k": 2, "beta": 0.9, "alpha": 1}}}


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_kill_then_rejoin_refuses_alone_then_heals(groups, tmp_path, variant):
    """The kill and rejoin of the test above, for fragments and for SparseLoCo: the fresh group 1,
    alone while group 0 is held back, is refused (no fresh state wins); then it heals from group 0
    in one fragment's sync (its step, the fragment, θ_global and the outer state), and both end
    with the same digest."""
    cfg, resume = VARIANTS[variant], tmp_path / "resume"
    a = groups.start("a", group=0, steps=16, pause_at=7, resume_file=str(resume), **cfg)
    b = groups.start("b", group=1, steps=16, pause_at=4, resume_file=str(tmp_path / "never"), **cfg)
    wait_for(lambda: any(r["step"] == 4 and r["committed"] for r in records(tmp_path / "b.jsonl")), "b's sync")
    b.kill()
    wait_for(lambda: any(r["members"] == [G0] and r["committed"] for r in records(tmp_path / "a.jsonl")),
             "a's sync without b")
    os.kill(a.pid, signal.SIGSTOP)  # no heartbeat: the Lighthouse lets the fresh group form quorums alone
    groups.start("b2", group=1, steps=16, **cfg)
    wait_for(lambda: any(r.get("refused") == "fresh" for r in records(tmp_path / "b2.jsonl")), "b2 refused alone")
    os.kill(a.pid, signal.SIGCONT)
    resume.touch()
    res = groups.results(2)
    assert res[0] == res[1] and res[0][2] == 16
    a, b2 = records(tmp_path / "a.jsonl"), records(tmp_path / "b2.jsonl")
    heal = next(r for r in b2 if r["healed"])
    assert heal["committed"] and heal["heals"] == [G1] and heal["participants"] == [G0] and heal["step"] == 8
    same = next(r for r in a if r["quorum_id"] == heal["quorum_id"] and r["committed"])
    assert same["digest"] == heal["digest"] and same["step"] == 8
    assert not any(r["healed"] for r in a if not r["join"])
    both = [r for r in b2 if r["committed"] and not r["healed"]]
    assert both and all(r["participants"] == [G0, G1] for r in both)
    if variant == "fragments":  # fragment f at steps 4k + 2(f + 1); top-k 1/4: 16 (weight) or 1 (bias) of 8 bytes
        assert heal["fragment"] == same["fragment"] == 1
        syncs = [r for r in a if not r["join"]]
        assert [r["step"] for r in syncs] == [2, 4, 6, 8, 10, 12, 14, 16]
        assert all(r["fragment"] == (r["step"] - 1) % 4 // 2 for r in syncs)
        assert all(r["bytes"] == {G0: 128, G1: 128} if r["fragment"] == 0 else r["bytes"] == {G0: 8, G1: 8}
                   for r in both)
    else:  # the sparseloco codec: weight 4 chunks x 2 (12 + 2 + 20 bytes), bias 1 chunk x 2 (3 + 1 + 20)
        assert all(r["bytes"] == {G0: 58, G1: 58} for r in both)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("guard", [True, False])
def test_fresh_replica_alone_never_becomes_the_state(groups, tmp_path, guard):
    """The single-member quorum: group 1 is killed and restarts fresh while group 0 is stopped
    (no heartbeat), so the restarted group forms quorums alone. Without the guard it commits its
    freshly initialised parameters, runs ahead, and group 0, when it resumes, heals *from it*:
    the cluster's history is lost. With the guard it never commits alone and heals from group 0."""
    resume = tmp_path / "resume"
    a = groups.start("a", group=0, steps=24, every=1, pause_at=4, resume_file=str(resume))
    b = groups.start("b", group=1, steps=24, every=1, pause_at=4, resume_file=str(tmp_path / "never"))
    for name in ("a", "b"):
        wait_for(lambda n=name: any(r["step"] == 4 and r["committed"] for r in records(tmp_path / f"{n}.jsonl")),
                 f"{name}'s 4th sync")
    os.kill(a.pid, signal.SIGSTOP)  # no heartbeat: the Lighthouse drops it
    b.kill()
    groups.start("b2", group=1, steps=24, every=1, guard=guard, pause_at=12, resume_file=str(resume))
    if guard:
        wait_for(lambda: sum(r.get("refused") == "fresh" for r in records(tmp_path / "b2.jsonl")) >= 3,
                 "b2's refused quorums")
    else:
        wait_for(lambda: any(r["step"] == 12 for r in records(tmp_path / "b2.jsonl")), "b2's 12 syncs alone")
    alone = [r for r in records(tmp_path / "b2.jsonl") if r["members"] == [G1]]
    assert alone and all(r["committed"] != guard for r in alone)
    os.kill(a.pid, signal.SIGCONT)
    resume.touch()
    res = groups.results(2)
    assert res[0] == res[1]
    a_heals = [r for r in records(tmp_path / "a.jsonl") if r["healed"] and not r["join"]]
    if guard:  # the cluster's state survives: the fresh group healed from group 0
        assert not a_heals and any(r["healed"] for r in records(tmp_path / "b2.jsonl"))
    else:  # reproduced: the fresh state won
        assert a_heals


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["diloco", *sorted(VARIANTS)])
def test_resume_from_checkpoints_is_bit_identical(groups, tmp_path, variant):
    """Both groups stop after 4 inner steps (a sync; with fragments, 3: between two fragments'
    syncs) and save; resumed from their checkpoints they rejoin at the same torchft step (no heal:
    min_replicas=2 keeps the first one back from committing alone) and end bit-identical to an
    uninterrupted run."""
    cfg = VARIANTS.get(variant, {})
    part = 3 if variant == "fragments" else 4
    other = _ft.start_lighthouse(1, heartbeat_timeout_ms=1000)  # the uninterrupted run's, alongside
    try:
        for g in (0, 1):
            groups.start(f"full{g}", group=g, steps=8, min_replicas=2, lighthouse=other.address(), **cfg)
            groups.start(f"part{g}", group=g, steps=part, min_replicas=2, save=str(tmp_path / f"ckpt{g}.pt"), **cfg)
        done = [groups.queue.get(timeout=90) for _ in range(4)]
    finally:
        other.shutdown()
    full = {g: (d, syncs, step) for g, d, syncs, step in done if step == 8}
    assert sorted(full) == [0, 1]
    for g in (0, 1):
        groups.start(f"resumed{g}", group=g, steps=8, min_replicas=2, load=str(tmp_path / f"ckpt{g}.pt"), **cfg)
    resumed = groups.results(2)
    assert resumed[0][0] == resumed[1][0] == full[0][0] == full[1][0]
    assert resumed[0][1] == full[0][1] + 1  # the resumed run's join sync
    for g in (0, 1):
        rejoin = next(r for r in records(tmp_path / f"resumed{g}.jsonl") if r["committed"])
        assert rejoin["join"] and rejoin["committed"] and not rejoin["heals"]
        assert rejoin["sync"] == (3 if variant == "fragments" else 4)  # join, 2 (and 4) before the stop
        assert rejoin.get("fragment", 0) == (None if variant == "fragments" else 0)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_pseudo_gradients_are_averaged_with_token_weights(groups, tmp_path):
    """Group 0 trains on 8 tokens a step, group 1 on 24: with a lossless exchange and an outer SGD
    of lr 1, the new θ_global is θ_global − (8·Δ₀ + 24·Δ₁)/32, the same floats on both groups."""
    import torch

    for g, tokens in ((0, 8), (1, 24)):
        groups.start(f"w{g}", group=g, steps=2, spec="none", outer_lr=1.0, momentum=0.0, tokens=tokens,
                     probe=str(tmp_path / f"probe{g}"))
    groups.results(2)
    before = [torch.load(tmp_path / f"probe{g}.before", weights_only=True) for g in (0, 1)]
    after = [torch.load(tmp_path / f"probe{g}.after", weights_only=True) for g in (0, 1)]
    assert [b["weight"] for b in before] == [16.0, 48.0]  # 2 inner steps each
    for i, g in enumerate(before[0]["global"]):
        assert torch.equal(g, before[1]["global"][i])
        deltas = [(g - b["local"][i]).reshape(-1) for b in before]
        avg = (deltas[0] * (16 / 64)).add_(deltas[1] * (48 / 64))
        want = g.clone().add_(avg.view(g.shape), alpha=-1.0)
        assert torch.equal(after[0][i], want) and torch.equal(after[1][i], want)
    ft0 = [r for r in records(tmp_path / "w0.jsonl") if r["committed"] and not r["join"]][0]
    assert ft0["weights"] == {G0: 16.0, G1: 48.0} and ft0["bytes"] == {G0: 68 * 4, G1: 68 * 4}


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_outer_step_is_exact(groups, tmp_path, variant):
    """The first regular sync, group 0 on 8 tokens a step and group 1 on 24. Fragments (lossless,
    outer SGD of lr 1): fragment 0 (the weight) moves by the token-weighted mean of its Δ, the bias
    stays. SparseLoCo: each coordinate moves by α times the token-weighted mean of the decoded codes
    over the groups that selected it, Σ wᵢĉᵢ / Σ wᵢ[ĉᵢ ≠ 0]; the same floats on both groups."""
    import torch

    from gradzip.compress.registry import create

    cfg = dict(VARIANTS[variant])
    if variant == "fragments":
        cfg.update(spec="none", outer_lr=1.0, momentum=0.0)
    for g, tokens in ((0, 8), (1, 24)):
        groups.start(f"w{g}", group=g, steps=2, tokens=tokens, probe=str(tmp_path / f"probe{g}"), **cfg)
    groups.results(2)
    before = [torch.load(tmp_path / f"probe{g}.before", weights_only=True) for g in (0, 1)]
    after = [torch.load(tmp_path / f"probe{g}.after", weights_only=True) for g in (0, 1)]
    assert [b["weight"] for b in before] == [16.0, 48.0]
    glob = before[0]["global"]
    assert all(torch.equal(a, b) for a, b in zip(glob, before[1]["global"]))
    deltas = [[(g - loc).float() for g, loc in zip(glob, b["local"])] for b in before]
    if variant == "fragments":
        avg = deltas[0][0] * (16 / 64) + deltas[1][0] * (48 / 64)
        want = [glob[0] - avg, glob[1]]
    else:
        codec = "sparseloco:chunk=4,k=2,bits=2,range=6,index=pack12,aggregate=selected,ef=true,ef_decay=0.9"
        dec = []
        for d in deltas:  # a fresh error memory: e = Δ, sent = decode(Q(TopK(e)))
            comp = create(codec)
            payload, ctx = comp.compress_batch(d, "ft")
            dec.append(torch.cat([t.reshape(-1) for t in comp.decompress_batch(payload, ctx)]))
        num = dec[0] * (16 / 64) + dec[1] * (48 / 64)
        den = (dec[0] != 0).float() * (16 / 64) + (dec[1] != 0).float() * (48 / 64)
        avg = num / den.masked_fill(den == 0, 1.0)
        assert bool((den < 1).any() and (den > 0).any())  # some coordinates selected by one group only
        flat = torch.cat([g.reshape(-1) for g in glob]) - avg
        want = [flat[:64].view(4, 16), flat[64:]]
    for a in after:
        for got, w in zip(a, want):
            assert torch.equal(got, w)
    assert all(torch.equal(x, y) for x, y in zip(after[0], after[1]))
    if variant == "fragments":
        assert torch.equal(after[0][1], glob[1])  # fragment 1 did not move


# ---------------------------------------------------------------------- bad input
def train(tmp_path: Path, sync: str, *extra: str) -> int:
    return main(["train", "--model", "bert-tiny", "--backend", "gloo", "--workers", "1", "--no-progress",
                 "--sync", sync, "--out", str(tmp_path / "run"), *extra])


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    with socket_closed() as port:
        assert train(tmp_path, f"ftdiloco:every=2,groups=2,lighthouse=http://127.0.0.1:{port},lighthouse_wait=0.5") == 2
    assert train(tmp_path, "ftdiloco:every=2,groups=2,lighthouse_wait=soon") == 2
    assert train(tmp_path, "ftdiloco:every=2,groups=2,min_replicas=3") == 2
    assert train(tmp_path, "ftdiloco:every=4,fragments=2,delay=1") == 2
    assert train(tmp_path, "ftsparseloco:groups=2", "--compressor", "topk") == 2
    assert train(tmp_path, "ftsparseloco:groups=2", "--backend", "sim") == 2
    assert train(tmp_path, "ftdiloco:every=2,groups=2", "--workers", "2", "--fsdp") == 2
    monkeypatch.setitem(sys.modules, "torchft", None)  # the ft extra missing
    assert train(tmp_path, "ftdiloco:every=2,groups=2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 8 and "Traceback" not in "".join(err)
    assert "no torchft Lighthouse answers at http://127.0.0.1:" in err[0] and "after 0.5 s" in err[0]
    assert "lighthouse_wait=soon must be a number of seconds >= 0" in err[1]
    assert "min_replicas=3 must be in [1, groups=2]" in err[2]
    assert "--sync ftdiloco: delay=1 is not fault-tolerant" in err[3]
    assert "--sync ftsparseloco sends its own codec" in err[4]
    assert "--sync ftsparseloco runs each replica group as its own run on --backend gloo" in err[5]
    assert "--sync ftdiloco replicates the model inside a replica group" in err[6] and "--fsdp" in err[6]
    assert err[7].endswith('fault tolerance needs torchft: pip install "gradzip[ft]"')


@pytest.mark.timeout(60)
def test_a_group_waits_for_a_lighthouse_that_starts_late():
    """``lighthouse_wait``: an address that starts answering within the wait is accepted (groups
    started together wait for the one that starts the Lighthouse); one that never does is refused
    after the wait, not before."""
    import socket
    import threading

    with socket_closed() as port:
        pass
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_late() -> None:
        time.sleep(0.8)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    t = threading.Thread(target=listen_late)
    t.start()
    try:
        with pytest.raises(GradzipError, match="no torchft Lighthouse answers"):
            _ft.check_lighthouse(f"http://127.0.0.1:{port}", wait=0.0)
        _ft.check_lighthouse(f"http://127.0.0.1:{port}", wait=20.0)
    finally:
        t.join()
        listener.close()
    with socket_closed() as closed:
        t0 = time.monotonic()
        with pytest.raises(GradzipError, match=r"after 0\.6 s"):
            _ft.check_lighthouse(f"http://127.0.0.1:{closed}", wait=0.6)
        assert time.monotonic() - t0 >= 0.5


class socket_closed:
    """A local port where nothing listens (bound, then closed)."""

    def __enter__(self) -> int:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        return port

    def __exit__(self, *exc: Any) -> None:
        return None


# ---------------------------------------------------------------------- under gradzip train
@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [1, 2])
def test_gradzip_train_two_groups_record_their_syncs(tmp_path, corpus, workers):
    """Two ``gradzip train`` runs, one per replica group (group 0 starts the Lighthouse), each of
    ``workers`` gloo ranks (DDP inside the group): every sync is in both runs' metrics.jsonl
    (``ft``: members, participants, bytes per participant), with the same digests, and
    summary.json names the group and its ranks."""
    with socket_closed() as port:
        pass
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        env.pop(k, None)

    def run(group: int, lighthouse: str) -> subprocess.Popen:
        argv = ["--model", "bert-tiny", "--seq-len", "64", "--batch-size", "4", "--eval-batches", "1",
                "--eval-every", "0", "--no-progress", "--corpus", str(corpus), "--steps", "4",
                "--backend", "gloo", "--workers", str(workers), "--compressor", "topk:ratio=0.01,ef=true",
                "--sync", f"ftdiloco:every=2,groups=2,group={group},lighthouse={lighthouse},lighthouse_port={port}",
                "--out", str(tmp_path / f"g{group}")]
        return subprocess.Popen([sys.executable, "-m", "gradzip", "train", *argv], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = run(0, "local")
    wait_for(lambda: port_open(port) or first.poll() is not None, "group 0's Lighthouse", limit=150)
    second = run(1, f"http://127.0.0.1:{port}")
    for p in (first, second):
        _, err = p.communicate(timeout=150)
        assert p.returncode == 0, err[-3000:]
    runs = [read_metrics(tmp_path / f"g{g}" / "metrics.jsonl") for g in (0, 1)]
    syncs = [[r["ft"] for r in rs if "ft" in r and r["ft"]["committed"]] for rs in runs]
    assert [r["step"] for r in runs[0]] == [1, 2, 3, 4]
    assert [s["sync"] for s in syncs[0]] == [s["sync"] for s in syncs[1]] == [1, 2, 3]  # join, step 2, step 4
    for a, b in zip(*syncs):
        assert a["digest"] == b["digest"] and a["members"] == b["members"] == [G0, G1]
    assert all(s["participants"] == [G0, G1] and s["bytes"][G0] == s["bytes"][G1] > 0 for s in syncs[0][1:])
    summary = json.loads((tmp_path / "g1" / "summary.json").read_text())
    assert (summary["ft_group"], summary["ft_groups"], summary["ft_digest"]) == (1, 2, syncs[1][-1]["digest"])
    assert summary["ft_ranks"] == workers and (tmp_path / "g1" / "ckpt-00000004-rank1.pt").exists() == (workers == 2)


def port_open(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def test_the_fault_tolerant_syncs_are_public_names():
    """``gradzip.FTDiLoCo``, ``gradzip.FTSparseLoCo`` and ``gradzip.start_lighthouse`` (the names
    the manual gives for a user's own loop) are the engine's, and the Lighthouse answers."""
    import gradzip
    from gradzip.engine.ftdiloco import FTDiLoCo
    from gradzip.engine.ftsparseloco import FTSparseLoCo

    assert gradzip.FTDiLoCo is FTDiLoCo and gradzip.FTSparseLoCo is FTSparseLoCo
    server = gradzip.start_lighthouse(1)
    try:
        _ft.check_lighthouse(server.address())
    finally:
        server.shutdown()
