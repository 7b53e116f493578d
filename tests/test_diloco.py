"""Rare synchronisation (``--sync diloco|localsgd``, :mod:`gradzip.engine.diloco`): the H = 1
equivalence with per-step SGD, LocalSGD = DiLoCo with an outer SGD of lr 1, exact bytes (1/H of
per-step, peak / P with fragments), delayed fragments hiding link time, resume identity between
syncs and at one, sim = gloo = mpi, the Hugging Face example's unchanged loop, and every bad
spelling's one-line error."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import gradzip
from gradzip.cli import main
from gradzip.comm.sim import SimWorld
from gradzip.compress.base import unflatten
from gradzip.errors import GradzipError, SpecError
from gradzip.plan.sync import parse_sync
from gradzip.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "bert-tiny", "--seq-len", "32", "--batch-size", "4", "--workers", "2", "--eval-batches", "2",
        "--eval-every", "4", "--lr", "2e-3", "--warmup", "2", "--no-progress", "--dropout", "0"]
SAME = ("step", "loss", "mlm_loss", "tokens", "bytes_sent", "bytes_recv", "grad_norm", "eval_loss", "syncs")


@pytest.fixture
def tiny(corpus) -> list[str]:
    return [*TINY, "--corpus", str(corpus)]


def train(*args: str) -> int:
    return main(["train", *args])


def records(out: Path) -> list[dict]:
    return read_metrics(out / "metrics.jsonl")


def computed(out: Path) -> list[tuple]:
    return [tuple(r.get(k) for k in SAME) for r in records(out)]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


# ---------------------------------------------------------------------- the spec
def test_sync_spellings_and_schedule():
    assert str(parse_sync(None)) == "step" and not parse_sync("step").outer
    d = parse_sync("diloco:every=16")
    assert (d.every, d.outer_lr, d.momentum, d.nesterov, d.fragments, d.delay) == (16, 0.7, 0.9, True, 1, 0)
    assert parse_sync(str(d)) == d
    l = parse_sync("localsgd:every=8")
    assert (l.outer_lr, l.momentum, l.nesterov) == (1.0, 0.0, False)
    s = parse_sync("diloco:every=16,fragments=4,delay=2")
    assert [s.send_step(f) for f in range(4)] == [2, 6, 10, 14]  # evenly spaced, the last applied at H
    assert [t for t in range(1, 33) if s.sends_at(t)] == [2, 6, 10, 14, 18, 22, 26, 30]


@pytest.mark.parametrize("text, why", [
    ("diloco", "needs every=H"), ("diloco:every=0", "must be >= 1"), ("diloco:every=x", "is not an integer"),
    ("diloco:every=16,fragments=3", "does not divide every=16"), ("diloco:every=16,fragments=4,delay=4",
                                                                  r"must be in \[0, H/P\)"),
    ("diloco:every=4,outer_lr=0", "positive"), ("diloco:every=4,momentum=1", r"in \[0, 1\)"),
    ("diloco:every=4,alpha=2", r"in \[0, 1\]"), ("localsgd:every=4,outer_lr=2", "has no parameter 'outer_lr'"),
    ("ring:every=4", "unknown --sync mode 'ring'"), ("diloco:every", "expected key=value")])
def test_bad_sync_spellings_are_one_line_errors(text, why):
    with pytest.raises(SpecError, match=why) as e:
        parse_sync(text)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("args, why", [
    (["--sync", "diloco:every=16,fragments=3"], "does not divide"),
    (["--sync", "diloco:every=8,fragments=2,delay=4"], "delay=4 must be in"),
    (["--sync", "diloco:every=4", "--optimizer", "onebit-adam"], "takes an inner optimizer"),
    (["--sync", "nope"], "unknown --sync mode"), (["--optimizer", "sgd", "--momentum", "1.5"], "--momentum")])
def test_bad_train_flags_exit_2_and_write_nothing(tmp_path, capsys, args, why):
    out = tmp_path / "run"
    assert train(*TINY, *args, "--steps", "2", "--out", str(out)) == 2
    err = capsys.readouterr().err.strip()
    assert why in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


# ---------------------------------------------------------------------- equivalences
def test_h1_with_sgd_equals_per_step_sgd(tmp_path, tiny):
    """DiLoCo, H = 1, inner SGD, outer SGD lr 1 without momentum = per-step SGD (the mean of the
    workers' updates is the update of the mean gradient); LocalSGD H = 1 likewise."""
    base = [*tiny, "--optimizer", "sgd", "--momentum", "0.5", "--lr", "0.05", "--clip", "0", "--steps", "6"]
    assert train(*base, "--out", str(tmp_path / "step")) == 0
    assert train(*base, "--sync", "diloco:every=1,outer_lr=1,momentum=0", "--out", str(tmp_path / "h1")) == 0
    assert train(*base, "--sync", "localsgd:every=1", "--out", str(tmp_path / "local")) == 0
    step = records(tmp_path / "step")
    for other in ("h1", "local"):
        for a, b in zip(records(tmp_path / other), step, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-6)
            if "eval_loss" in b:
                assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-6, abs=1e-6)
    s = summary(tmp_path / "h1")
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5  # it trained


class Layers(nn.Module):
    """4 equal bias-free layers: with a small bucket cap, one bucket each (fragments split exactly)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(48, 48, bias=False) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def run_api(cls: type, steps: int, sync_every: int, compressor: str = "none", n: int = 2,
            outer: str = "sgd1", **kw) -> tuple[nn.Module, list[int]]:
    """Train :class:`Layers` on n sim workers through the Python API; per-step bytes (mean per worker)."""
    model = Layers()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    world = SimWorld(n, "1gbit", "50us")
    if cls is gradzip.LocalSGD:
        sync = cls(model, inner, world, sync_every, compressor, bucket_cap_mb=0.005, **kw)
    else:
        o = torch.optim.SGD(model.parameters(), lr=1.0) if outer == "sgd1" else \
            torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        sync = cls(model, inner, o, world, sync_every, compressor, bucket_cap_mb=0.005, **kw)
    g = torch.Generator().manual_seed(1)
    per_step = []
    for _ in range(steps):
        before = [c.stats.bytes_sent for c in world.comms]
        for w in sync.worker_ids:
            with sync.worker(w):
                x = torch.randn(16, 48, generator=g)
                model(x).square().mean().backward()
                inner.step()
                inner.zero_grad()
        per_step.append(round(sum(c.stats.bytes_sent - b for c, b in zip(world.comms, before)) / n))
    return model, per_step


def test_localsgd_equals_diloco_with_outer_sgd_lr_1():
    a, _ = run_api(gradzip.LocalSGD, 8, 4)
    b, _ = run_api(gradzip.DiLoCo, 8, 4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c, _ = run_api(gradzip.DiLoCo, 8, 4, outer="nesterov")
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


@pytest.mark.parametrize("compressor", ["none", "topk:ratio=0.05,ef=true", "intk:bits=4", "powersgd:rank=2"])
def test_bytes_per_step_are_one_over_h_and_fragments_cut_the_peak(compressor):
    """Same compressor: a sync sends what one per-step exchange sends, so bytes per step are
    exactly 1/H; with P fragments each sync sends 1/P of it (equal buckets here)."""
    _, per_step = run_api(gradzip.DiLoCo, 8, 1, compressor)  # H = 1: one exchange per step
    _, every4 = run_api(gradzip.DiLoCo, 8, 4, compressor)
    assert per_step[0] > 0 and len(set(per_step)) == 1
    assert every4 == [0, 0, 0, per_step[0]] * 2
    assert sum(every4) * 4 == sum(per_step)
    _, frag = run_api(gradzip.DiLoCo, 8, 4, compressor, fragments=4)
    assert sum(frag) == sum(every4) and max(frag) * 4 == max(every4)
    assert [b > 0 for b in frag] == [True] * 8  # one fragment per step


def test_delay_hides_link_time_behind_inner_steps():
    stats = {}
    for delay in (0, 1):
        m = Layers()
        world = SimWorld(2, "10mbit", "1ms")
        inner = torch.optim.SGD(m.parameters(), lr=0.01)
        outer = torch.optim.SGD(m.parameters(), lr=1.0)
        d = gradzip.DiLoCo(m, inner, outer, world, 4, fragments=2, fragment_sync_delay=delay,
                           bucket_cap_mb=0.005, hook=False)
        out = [d.after_inner_step(compute_s=0.005) for _ in range(4)]
        stats[delay] = out
    link = sum(s.link_s for s in stats[0])
    assert link > 0.01 and sum(s.exposed_s for s in stats[0]) == pytest.approx(link)
    assert sum(s.link_s for s in stats[1]) == pytest.approx(link)
    assert sum(s.exposed_s for s in stats[1]) == pytest.approx(max(0.0, link / 2 - 0.005) * 2)
    assert [s.applied for s in stats[1]] == [0, 1, 0, 1] and [s.sent for s in stats[1]] == [1, 0, 1, 0]


def test_alpha_mixes_the_local_parameters_into_the_merge():
    """α = 0.5 (Streaming DiLoCo's mixing): after a sync each worker holds (θ_local + θ_global) / 2,
    while θ_global is the outer step's result."""
    m, start = Layers(), Layers()
    world = SimWorld(2)
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    d = gradzip.DiLoCo(m, inner, torch.optim.SGD(m.parameters(), lr=1.0), world, 1, fragment_update_alpha=0.5,
                       bucket_cap_mb=0.005)
    for w in d.worker_ids:
        with d.worker(w):
            for p in m.parameters():
                p.grad = torch.full_like(p, float(w + 1))
            inner.step()
    # θ_w = θ0 − 0.1·(w+1); θ_global = their mean = θ0 − 0.15; worker w: (θ_w + θ_global) / 2
    for w, shift in ((1, 0.175), (0, 0.125)):
        with d.worker(w):
            for p, p0 in zip(m.parameters(), start.parameters()):
                torch.testing.assert_close(p.detach(), p0.detach() - shift)
    flat0 = [torch.cat([q.detach().reshape(-1) for q in b.params]) for b in d.buckets]
    for g, p0 in zip(d.global_, flat0):  # the model now shows worker 0: θ0 − 0.125
        torch.testing.assert_close(g, p0 - 0.025)


def test_api_refuses_what_it_cannot_honour():
    m = Layers()
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    other = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=1.0)
    with pytest.raises(GradzipError, match="outer optimizer must be built over the model's parameters"):
        gradzip.DiLoCo(m, inner, other, SimWorld(2), 4)
    with pytest.raises(GradzipError, match="fragments=3 does not divide"):
        gradzip.DiLoCo(m, inner, torch.optim.SGD(m.parameters(), lr=1.0), SimWorld(2), 4, fragments=3)
    ddp_like = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    with pytest.raises(GradzipError, match="replaces DDP's per-step allreduce"):
        gradzip.DiLoCo(ddp_like, inner, torch.optim.SGD(m.parameters(), lr=1.0), SimWorld(2), 4)
    one = nn.Linear(8, 8, bias=False)  # one parameter: no way to make two fragments of whole tensors
    with pytest.raises(GradzipError, match="only 1 bucket;"):
        gradzip.DiLoCo(one, torch.optim.SGD(one.parameters(), lr=0.1), torch.optim.SGD(one.parameters(), lr=1.0),
                       SimWorld(2), 4, fragments=2)
    # with the default 25 MiB cap the 4 layers fit in one bucket, yet 4 fragments are made
    d = gradzip.DiLoCo(m, inner, torch.optim.SGD(m.parameters(), lr=1.0), SimWorld(2), 4, fragments=4)
    assert [len(f) for f in d.fragments] == [1, 1, 1, 1]


# ---------------------------------------------------------------------- sim: each worker's inner optimizer
def _replica(d: gradzip.DiLoCo, w: int, m: nn.Module) -> bool:
    """Worker w's parameters in d equal m's, bit for bit."""
    return all(torch.equal(d.replicas[w][bi], torch.cat([m.get_parameter(n).detach().reshape(-1) for n in b.names]))
               for bi, b in enumerate(d.buckets))


@pytest.mark.parametrize("kind", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_sim_with_foreach_adamw_equals_one_optimizer_per_worker(kind):
    """Each simulated worker owns its inner state (a foreach or fused AdamW, an LR schedule that changes
    lr every step): DiLoCo on sim gives, bit for bit, what N separate models with an AdamW each give
    when they are set to θ_global at every sync; the moments carry over the syncs, per worker."""
    n, h = 2, 3
    model = Layers()
    refs = [Layers() for _ in range(n)]
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, **kind)
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1.0 / (1 + s))
    ref_opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, **kind) for m in refs]
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    d = gradzip.DiLoCo(model, inner, outer, SimWorld(n), h, bucket_cap_mb=0.005)
    g = torch.Generator().manual_seed(1)
    for step in range(1, 3 * h):
        xs = [torch.randn(16, 48, generator=g) for _ in range(n)]
        lr = schedule.get_last_lr()[0]
        for w in d.worker_ids:
            with d.worker(w):
                model(xs[w]).square().mean().backward()
                inner.step()
        schedule.step()
        for m, opt, x in zip(refs, ref_opts, xs):
            opt.param_groups[0]["lr"] = lr
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
        if step % h == 0:  # the sync: every worker goes on from θ_global
            assert not _replica(d, 0, refs[0])
            with torch.no_grad():
                for m in refs:
                    for b, flat in zip(d.buckets, d.global_):
                        for name, v in zip(b.names, unflatten(flat, b.shapes)):
                            m.get_parameter(name).copy_(v)
        assert all(_replica(d, w, m) for w, m in enumerate(refs)), step
    assert inner.param_groups[0]["lr"] == schedule.get_last_lr()[0] == 1e-2 / (3 * h)


class _Watched(torch.optim.AdamW):
    """AdamW that records each attribute gradzip's code assigns on it (its own and torch's code,
    load_state_dict included, may do as they please)."""

    def __setattr__(self, name: str, value: object) -> None:
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith(str(Path(gradzip.__file__).parent) + os.sep):
            self.__dict__.setdefault("assigned", []).append(f"{name} from {caller}")
        super().__setattr__(name, value)


def test_sim_swaps_inner_state_only_through_the_optimizers_own_api():
    """DiLoCo never assigns an attribute of the inner optimizer (no ``inner.state = ...``): every
    swap of a worker's state, a checkpoint and a resume go through ``state_dict`` and
    ``load_state_dict``, whose hooks run each time; the workers' states stay apart."""
    model = Layers()
    inner = _Watched(model.parameters(), lr=1e-2, foreach=True)
    loads: list[int] = []
    inner.register_load_state_dict_post_hook(lambda opt: loads.append(1))
    d = gradzip.DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=1.0), SimWorld(2), 2, "intk:bits=4",
                       bucket_cap_mb=0.005)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        for w in d.worker_ids:
            with d.worker(w):
                model(torch.randn(8, 48, generator=g)).square().mean().backward()
                inner.step()
    assert len(loads) == 6  # one load per worker and step
    buf = io.BytesIO()
    torch.save(d.state_dict(), buf)
    model2 = Layers()
    inner2 = _Watched(model2.parameters(), lr=1e-2, foreach=True)
    d2 = gradzip.DiLoCo(model2, inner2, torch.optim.SGD(model2.parameters(), lr=1.0), SimWorld(2), 2, "intk:bits=4",
                        bucket_cap_mb=0.005)
    d2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert "assigned" not in vars(inner) and "assigned" not in vars(inner2), vars(inner).get("assigned")
    moments = []
    for dd, opt in ((d, inner), (d2, inner2)):
        for w in dd.worker_ids:
            with dd.worker(w):
                moments.append([opt.state[p]["exp_avg"].clone() for p in dd.params])
    same = [all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(moments[:2], moments[2:])]
    assert same == [True, True]  # the resumed run holds each worker's own state
    assert not all(torch.equal(a, b) for a, b in zip(moments[0], moments[1]))  # worker 0's is not worker 1's


def test_sim_refuses_an_inner_optimizer_whose_load_changes_its_state():
    """torch's load_state_dict casts state to the parameters' dtype: an optimizer that keeps fp32
    state for bf16 parameters cannot have its workers' states swapped through it (one-line error)."""

    class Fp32Momentum(torch.optim.Optimizer):
        def __init__(self, params: object) -> None:
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure: object = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    m = self.state[p].setdefault("m", torch.zeros_like(p, dtype=torch.float32))
                    p.sub_(m.add_(p.grad.float()).to(p.dtype), alpha=group["lr"])

    model = Layers().to(torch.bfloat16)
    inner = Fp32Momentum(model.parameters())
    d = gradzip.DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=1.0), SimWorld(2), 4)
    for w in d.worker_ids:
        with d.worker(w):
            model(torch.ones(2, 48, dtype=torch.bfloat16)).float().square().mean().backward()
            inner.step()
    with pytest.raises(GradzipError, match="turns worker 0's state 'm' from torch.float32 into torch.bfloat16"):
        with d.worker(0):
            pass


# ---------------------------------------------------------------------- gradzip train
@pytest.mark.parametrize("stop", [3, 4])
def test_resume_is_bit_identical_between_syncs_and_at_one(tmp_path, tiny, stop):
    """H = 4, two fragments, delay 1 (sent at steps 1 and 3, applied at 2 and 4), top-k + EF:
    a checkpoint at step 3 holds a fragment in flight; at step 4 the model has just synced."""
    args = [*tiny, "--steps", "8", "--sync", "diloco:every=4,fragments=2,delay=1", "--compressor",
            "topk:ratio=0.05,ef=true", "--bucket-cap-mb", "0.5", "--eval-every", "1"]  # (a stop evaluates)
    full, part = tmp_path / "full", tmp_path / "part"
    assert train(*args, "--out", str(full)) == 0
    assert train(*args, "--stop-at", str(stop), "--out", str(part)) == 0
    assert train("--out", str(part), "--resume") == 0
    assert computed(part) == computed(full)
    s = summary(full)
    assert s["sync"] == "diloco:every=4,outer_lr=0.7,momentum=0.9,fragments=2,delay=1"
    assert s["syncs"] == 4 and s["bytes_total"] == sum(r["bytes_sent"] for r in records(full))
    assert s["bytes_per_sync"] == s["bytes_total"] / 4 and s["bytes_per_step"] == s["bytes_total"] / 8


def _launch(backend: str, args: list[str], out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "gradzip", "train", "--backend", backend, *args, "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_sim_equals_gloo_and_mpi(tmp_path, tiny, backend):
    """H = 1 DiLoCo with SGD on real processes = per-step SGD on sim; streaming DiLoCo with a
    compressor and delayed fragments: the same losses and bytes as sim, and a resume between syncs
    is bit-identical."""
    if backend == "mpi":
        from conftest import mpi_unavailable

        if why := mpi_unavailable():
            pytest.skip(why)
    base = [*tiny, "--optimizer", "sgd", "--lr", "0.05", "--clip", "0", "--steps", "4", "--checkpoint-every", "0"]
    assert train(*base, "--out", str(tmp_path / "sim-step")) == 0
    _launch(backend, [*base, "--sync", "diloco:every=1,outer_lr=1,momentum=0"], tmp_path / "h1")
    for a, b in zip(records(tmp_path / "h1"), records(tmp_path / "sim-step"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-6)
    stream = [*tiny, "--steps", "8", "--sync", "diloco:every=4,fragments=2,delay=1", "--compressor",
              "topk:ratio=0.05,ef=true", "--bucket-cap-mb", "0.5"]
    assert train(*stream, "--out", str(tmp_path / "sim")) == 0
    _launch(backend, [*stream, "--stop-at", "3"], tmp_path / "real")
    _launch(backend, ["--resume"], tmp_path / "real")
    real, sim = records(tmp_path / "real"), records(tmp_path / "sim")
    assert [r["step"] for r in real] == list(range(1, 9)) and real[0]["clock"] == "measured"
    for a, b in zip(real, sim, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert (a["bytes_sent"], a["syncs"], a["tokens"]) == (b["bytes_sent"], b["syncs"], b["tokens"])


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_hf_bert_trains_in_an_unchanged_loop(tmp_path):
    """examples/diloco_hf.py under torchrun: plain `backward(); inner.step()`, DiLoCo with int8
    pseudo-gradients; the loss falls and, after the last sync, the replicas agree."""
    pytest.importorskip("transformers")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "examples" / "diloco_hf.py"), "--sync-every", "8", "--compressor", "intk:bits=8",
           "--steps", "32", "--out", str(tmp_path)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = (torch.load(tmp_path / f"replica-rank{r}.pt", weights_only=True) for r in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = torch.load(tmp_path / "losses-rank0.pt", weights_only=True)["losses"]
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4])
