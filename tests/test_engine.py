"""The gradient-exchange engine in one process: sim mode (N virtual workers, one model), and the
real-backend code path driven by a threaded SimWorld (one model replica and engine per thread)."""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
from torch import nn

from gradzip.cluster.schedule import BucketTiming, model_step
from gradzip.comm import cost
from gradzip.comm.sim import SimWorld
from gradzip.compress import create, registry
from gradzip.engine import StepStats, attach
from gradzip.engine.handshake import check_agreement, fingerprint
from gradzip.errors import GradzipError
from gradzip.plan.buckets import MiB


class Net(nn.Module):
    """Two compressible matrices, small tensors, an odd 7-element parameter and an empty one."""

    def __init__(self, d_in: int = 12, hidden: int = 40, d_out: int = 5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, d_out)
        self.odd = nn.Parameter(torch.linspace(-1, 1, 7))
        self.empty = nn.Parameter(torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.fc1(x)))
        h = torch.relu(self.fc2(h))
        return self.head(h) + self.odd.sum() * 0.1 + self.empty.sum()


def data(n_workers: int, step: int = 0, batch: int = 6, d_in: int = 12, d_out: int = 5):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)) for _ in range(n_workers)]


def loss_of(model: nn.Module, xy) -> torch.Tensor:
    return nn.functional.mse_loss(model(xy[0]), xy[1])


def run_step(engine, model, batches, micro: int = 1) -> StepStats:
    for w in engine.worker_ids:
        with engine.worker(w):
            xs, ys = batches[w][0].chunk(micro), batches[w][1].chunk(micro)
            for m in range(micro):
                ctx = engine.no_sync() if m < micro - 1 else _null()
                with ctx:
                    (loss_of(model, (xs[m], ys[m])) / micro).backward()
    return engine.finalize()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def manual_mean_grads(model: nn.Module, batches) -> list[torch.Tensor]:
    ref = copy.deepcopy(model)
    acc = [torch.zeros_like(p) for p in ref.parameters()]
    for xy in batches:
        ref.zero_grad(set_to_none=True)
        loss_of(ref, xy).backward()
        for a, p in zip(acc, ref.parameters()):
            if p.grad is not None:
                a += p.grad
    return [a / len(batches) for a in acc]


@torch.no_grad()
def sgd_step(model: nn.Module, lr: float = 0.05) -> None:
    """Plain SGD (torch.optim's first step imports torch._dynamo, seconds of start-up)."""
    for p in model.parameters():
        p.add_(p.grad, alpha=-lr)


def run_ranks(rank_main, n: int, timeout: float = 50) -> None:
    """``rank_main(r)`` for r in range(n), one thread each (a threaded SimWorld's ranks); the
    first exception of any rank is raised here."""
    errors: list[BaseException] = []

    def guarded(r: int) -> None:
        try:
            rank_main(r)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a rank thread did not finish"


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


# ------------------------------------------------------------------ averaging, buckets
def test_none_equals_manual_average_over_workers():
    torch.manual_seed(0)
    model = Net()
    batches = data(3)
    expected = manual_mean_grads(model, batches)
    engine = attach(model, "none", SimWorld(3), bucket_cap_mb=0.002, min_compress_numel=64)
    stats = run_step(engine, model, batches)
    for e, g in zip(expected, grads(model)):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
    assert stats.clock == "modelled" and stats.buckets == len(engine.buckets) > 1
    assert model.empty.grad is not None and model.empty.grad.shape == (0,)


def test_bucketing_respects_cap_reverse_order_kinds_and_dtypes():
    model = nn.Sequential(nn.Linear(30, 30), nn.Linear(30, 30), nn.Linear(30, 30), nn.Linear(30, 30))
    model[2].to(torch.bfloat16)  # a bf16 layer in an fp32 model
    cap_mb = 2000 * 4 / MiB  # room for two 30x30 fp32 weights (3600 B each), not three
    engine = attach(model, "topk:ratio=0.1", SimWorld(2), bucket_cap_mb=cap_mb, min_compress_numel=100)
    names = [n for n, p in model.named_parameters()]
    pos = {n: i for i, n in enumerate(reversed(names))}
    for b in engine.buckets:
        assert {p.dtype for p in b.params} == {b.dtype}
        assert all((p.numel() >= 100) == b.compressed for p in b.params)
        assert b.nbytes <= cap_mb * MiB or len(b.params) == 1
        order = [pos[n] for n in b.names]
        assert order == sorted(order)  # reverse registration order inside a bucket
    last = [max(pos[n] for n in b.names) for b in engine.buckets]
    assert last == sorted(last)  # buckets ordered by when they are expected to be ready
    assert sorted(n for b in engine.buckets for n in b.names) == sorted(names)
    kinds = {(b.compressed, b.dtype) for b in engine.buckets}
    assert kinds == {(True, torch.float32), (True, torch.bfloat16), (False, torch.float32), (False, torch.bfloat16)}
    # With `none` small tensors are not split off: fewer collectives.
    plain = attach(copy.deepcopy(model), "none", SimWorld(2), bucket_cap_mb=cap_mb)
    assert all(b.compressed for b in plain.buckets)


def test_buckets_launch_in_index_order_during_backward():
    torch.manual_seed(0)
    model = Net()
    engine = attach(model, "none", SimWorld(2), bucket_cap_mb=0.001, min_compress_numel=0)
    w0 = engine._workers[0]
    with engine.worker(0):
        loss_of(model, data(1)[0]).backward()
        launched_in_backward = w0.next_launch
    assert launched_in_backward == len(engine.buckets)  # everything was used: all launched in backward
    with engine.worker(1):
        pass  # worker 1 computes nothing: its buckets go out as zeros at the end of its block
    engine.finalize()
    # A parameter that never gets a gradient holds back every later bucket (index order), not earlier ones.
    with engine.worker(0):
        out = model.head(torch.relu(model.fc2(torch.randn(3, 40))))
        out.sum().backward()
        stuck = next(b.index for b in engine.buckets if "fc1.weight" in b.names or "fc1.bias" in b.names
                     or "norm.weight" in b.names or "norm.bias" in b.names or "odd" in b.names)
        assert w0.next_launch == stuck
    with engine.worker(1):
        pass
    engine.finalize()


def test_no_sync_accumulation_equals_one_big_batch():
    torch.manual_seed(1)
    model = Net()
    batches = data(2, batch=12)
    expected = manual_mean_grads(model, batches)
    engine = attach(model, "none", SimWorld(2), bucket_cap_mb=0.002, min_compress_numel=64)
    run_step(engine, model, batches, micro=3)
    for e, g in zip(expected, grads(model)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_unused_parameters_do_not_hang_and_average_correctly():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)       # used by worker 0 only
            self.never = nn.Linear(8, 8)   # used by nobody
            self.out = nn.Linear(8, 1)

        def forward(self, x, use_b):
            h = torch.relu(self.a(x))
            if use_b:
                h = h + self.b(h)
            return self.out(h)

    torch.manual_seed(2)
    model = Branchy()
    ref = copy.deepcopy(model)
    xs = [torch.randn(4, 8) for _ in range(2)]
    engine = attach(model, "none", SimWorld(2), bucket_cap_mb=0.0005, min_compress_numel=0)
    for _ in range(2):  # twice: the step after an incomplete one must work as well
        for w in engine.worker_ids:
            with engine.worker(w):
                model(xs[w], use_b=(w == 0)).sum().backward()
        engine.finalize()
    ref_grads = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for w in range(2):
        ref.zero_grad(set_to_none=True)
        ref(xs[w], use_b=(w == 0)).sum().backward()
        for n, p in ref.named_parameters():
            if p.grad is not None:
                ref_grads[n] += p.grad / 2
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-6, atol=1e-7)
    assert torch.count_nonzero(model.never.weight.grad) == 0


def test_misuse_gives_clear_errors():
    model = Net()
    engine = attach(model, "none", SimWorld(2))
    with pytest.raises(GradzipError, match="engine.worker"):
        loss_of(model, data(1)[0]).backward()
    with pytest.raises(GradzipError, match=r"worker\(s\) \[1\] did not run"):
        with engine.worker(0):
            loss_of(model, data(1)[0]).backward()
        engine.finalize()
    engine2 = attach(Net(), "none", SimWorld(1))
    with pytest.raises(GradzipError, match="second gradient"):
        with engine2.worker(0):
            loss_of(engine2.model, data(1)[0]).backward()
            loss_of(engine2.model, data(1)[0]).backward()
    with pytest.raises(GradzipError, match="bucket_cap_mb"):
        attach(Net(), "none", SimWorld(1), bucket_cap_mb=0)
    with pytest.raises(GradzipError, match="unknown compressor"):
        attach(Net(), "nosuch", SimWorld(1))


def test_fingerprint_mismatch_names_ranks_and_what_differs():
    m = list(Net().named_parameters())
    opts = {"bucket_cap_mb": 25.0, "min_compress_numel": 1024}
    good = fingerprint(m, "topk:ratio=0.01", opts)
    other_spec = fingerprint(m, "topk:ratio=0.02", opts)
    other_model = fingerprint(m[:-1], "topk:ratio=0.01", opts)
    world = SimWorld(3)
    with pytest.raises(GradzipError, match=r"compressor spec differs on rank\(s\) \[2\].*ratio=0.02"):
        check_agreement(world.comms, [good, good, other_spec])
    with pytest.raises(GradzipError, match=r"model differs on rank\(s\) \[1\]"):
        check_agreement(world.comms, [good, other_model, good])
    check_agreement(world.comms, [good, good, good])


# ------------------------------------------------------------------ virtual clock
def test_model_step_arithmetic_on_a_controlled_case():
    # compute 10; bucket 0 ready at 4 (encode 1) -> link [5, 8]; bucket 1 ready at 7 (+1 earlier encode,
    # encode 1) -> launch 9, link [9, 12]; backward ends at 10 + 2 = 12; decodes 0.5 each:
    # t = max(12, 8) + 0.5 = 12.5, then max(12.5, 12) + 0.5 = 13.
    b = [BucketTiming(4, 1, [3], [], 0.5), BucketTiming(7, 1, [3], [], 0.5)]
    m = model_step(10.0, b)
    assert m.step_s == pytest.approx(13.0) and m.compress_s == pytest.approx(3.0)
    assert m.comm_s == pytest.approx(0.0) and m.link_s == pytest.approx(6.0)
    # A slow link: rounds of 20 -> link [5, 25], [25, 45]; t = 45.5 after decoding the last one.
    m = model_step(10.0, [BucketTiming(4, 1, [20], [], 0.5), BucketTiming(7, 1, [20], [], 0.5)])
    assert m.step_s == pytest.approx(45.5)
    assert m.comm_s == pytest.approx(45.5 - 10 - 3)
    # Two rounds: round 0 on [5, 8], finalize at 11 computes 2 and sends round 1 on [13, 17], decode 1.
    m = model_step(10.0, [BucketTiming(4, 1, [3, 4], [2], 1)])
    assert m.step_s == pytest.approx(18.0) and m.comm_s == pytest.approx(18 - 10 - 4)


def _expected_link_time(engine, world) -> float:
    """The α–β time of every collective this engine issues for `none`: one allreduce per bucket."""
    return sum(cost.allreduce_time(b.nbytes, world.n, world.link) for b in engine.buckets)


def test_virtual_clock_slow_link_comm_dominates_fast_link_hides_it():
    torch.manual_seed(3)
    batches = data(4)
    slow_world = SimWorld(4, bandwidth="1mbit", latency="1ms")
    model = Net(hidden=64)
    engine = attach(model, "none", slow_world, bucket_cap_mb=0.004, min_compress_numel=64)
    st = run_step(engine, model, batches)
    assert st.link_s == pytest.approx(_expected_link_time(engine, slow_world), rel=1e-9)
    assert st.step_s == pytest.approx(st.compute_s + st.compress_s + st.comm_s)
    # The link is serial: at least everything after the end of backward is exposed.
    assert st.comm_s >= st.link_s - st.compute_s - st.compress_s - 1e-12
    assert st.comm_s > 0.5 * st.step_s  # ~0.1 s of modelled traffic against a tiny model's compute
    fast = SimWorld(4, bandwidth=1e18, latency=0)
    model2 = Net(hidden=64)
    engine2 = attach(model2, "none", fast, bucket_cap_mb=0.004, min_compress_numel=64)
    st2 = run_step(engine2, model2, batches)
    assert st2.comm_s == pytest.approx(0.0, abs=1e-9)
    assert st2.step_s == pytest.approx(st2.compute_s + st2.compress_s)


# ------------------------------------------------------------------ every compressor
def _expected_bytes(engine) -> int:
    """Bytes one rank sends per step with 2 workers: ring allreduce and ring allgather of equal
    sizes both send exactly the payload (factor 2(n-1)/n = n-1 = 1)."""
    comp = engine.compressor
    total = 0
    for b in engine.buckets:
        if b.compressed:
            total += comp.batch_payload_bytes(b.shapes, b.dtype)
        else:
            total += b.nbytes
    return total


@pytest.mark.parametrize("name", sorted(registry()))
def test_every_compressor_runs_through_the_engine(name):
    torch.manual_seed(4)
    model = Net()
    engine = attach(model, name, SimWorld(2), bucket_cap_mb=0.002, min_compress_numel=32)
    for step in range(3):
        st = run_step(engine, model, data(2, step))
        if engine.compressor.fixed_size:
            assert st.bytes_sent == _expected_bytes(engine), name
        else:  # a data-dependent size: the formula bounds it (the size exchange is a few bytes per bucket)
            assert 0 < st.bytes_sent <= _expected_bytes(engine) + 16 * len(engine.buckets), name
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        sgd_step(model)
    assert model.odd.grad.shape == (7,) and model.empty.grad.shape == (0,)


@pytest.mark.parametrize("name", sorted(registry()))
def test_odd_sized_parameters_go_through_every_compressor(name):
    torch.manual_seed(5)
    model = Net()
    engine = attach(model, name, SimWorld(3), bucket_cap_mb=0.0001, min_compress_numel=0)
    assert any(b.names == ["odd"] and b.compressed for b in engine.buckets)  # 7 elements, compressed
    st = run_step(engine, model, data(3))
    assert st.bytes_sent > 0
    assert model.odd.grad.shape == (7,) and torch.isfinite(model.odd.grad).all()
    if create(name).lossless:
        odd_index = [n for n, _ in model.named_parameters()].index("odd")
        expected = manual_mean_grads(model, data(3))[odd_index]
        torch.testing.assert_close(model.odd.grad, expected, rtol=1e-3, atol=1e-4)


def test_allreduce_bytes_follow_the_ring_factor():
    model = nn.Linear(64, 64, bias=False)  # 16384 bytes, one bucket
    engine = attach(model, "none", SimWorld(4))
    st = run_step(engine, model, [(torch.randn(2, 64), torch.randn(2, 64))] * 4)
    assert st.bytes_sent == st.bytes_recv == 2 * 3 * 16384 // 4


# ------------------------------------------------------------------ state, dtypes
def _resume_specs() -> list[str]:
    """Every registered compressor (default settings), with EF and with EF21 where it is biased."""
    out = []
    for name, cls in sorted(registry().items()):
        out += [name, f"{name}:ef=true"] + ([f"{name}:ef=ef21"] if cls.biased else [])
    return out


@pytest.mark.parametrize("spec", _resume_specs())
def test_state_dict_round_trip_continues_identically(spec):
    torch.manual_seed(6)
    model = Net()
    twin = copy.deepcopy(model)
    kw = dict(bucket_cap_mb=0.002, min_compress_numel=32)
    engine = attach(model, spec, SimWorld(2), **kw)
    for step in range(2):
        run_step(engine, model, data(2, step))
        sgd_step(model)
    buf = io.BytesIO()
    torch.save({"engine": engine.state_dict(), "model": model.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    twin.load_state_dict(saved["model"])
    engine2 = attach(twin, spec, SimWorld(2), **kw)
    engine2.load_state_dict(saved["engine"])
    run_step(engine, model, data(2, 2))
    run_step(engine2, twin, data(2, 2))
    for a, b in zip(grads(model), grads(twin)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(GradzipError, match="workers"):
        attach(copy.deepcopy(twin), spec, SimWorld(3), **kw).load_state_dict(saved["engine"])


@pytest.mark.parametrize("spec", ["none", "topk:ratio=0.2,ef=true", "powersgd:rank=2"])
def test_bf16_parameters_and_cpu_autocast(spec):
    torch.manual_seed(7)
    model = Net().to(torch.bfloat16)
    engine = attach(model, spec, SimWorld(2), min_compress_numel=32)
    assert {b.dtype for b in engine.buckets} == {torch.bfloat16}
    batches = [(x.bfloat16(), y.bfloat16()) for x, y in data(2)]
    run_step(engine, model, batches)
    assert all(p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad.float()).all() for p in model.parameters())
    # fp32 parameters under CPU autocast: gradients stay fp32, averaged like the manual reference.
    model32 = Net()
    ref = manual_mean_grads_autocast(model32, data(2))
    engine32 = attach(model32, "none", SimWorld(2), min_compress_numel=32)
    for w in engine32.worker_ids:
        with engine32.worker(w), torch.autocast("cpu", dtype=torch.bfloat16):
            loss_of(model32, data(2)[w]).float().backward()
    engine32.finalize()
    for e, g in zip(ref, grads(model32)):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


def manual_mean_grads_autocast(model, batches):
    ref = copy.deepcopy(model)
    acc = [torch.zeros_like(p) for p in ref.parameters()]
    for xy in batches:
        ref.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_of(ref, xy).float().backward()
        for a, p in zip(acc, ref.parameters()):
            a += p.grad
    return [a / len(batches) for a in acc]


# ------------------------------------------------------------------ real-backend code path
@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", ["none", "topk:ratio=0.1,ef=true", "powersgd:rank=2"])
def test_real_mode_threads_match_sim_mode(spec):
    """One engine per rank (the path real backends take), ranks as threads of a threaded SimWorld."""
    torch.manual_seed(8)
    base = Net()
    kw = dict(bucket_cap_mb=0.002, min_compress_numel=32)
    sim_model = copy.deepcopy(base)
    sim_engine = attach(sim_model, spec, SimWorld(2), **kw)
    sim_grads = []
    for step in range(2):
        run_step(sim_engine, sim_model, data(2, step))
        sim_grads.append(grads(sim_model))
        sgd_step(sim_model)

    world = SimWorld(2, threaded=True, timeout=30)
    out: dict[int, list] = {}

    def rank_main(r: int) -> None:
        model = copy.deepcopy(base)
        if r == 1:  # rank 0's parameters win the start-up broadcast
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        engine = attach(model, spec, world[r], **kw)
        res = []
        for step in range(2):
            model.zero_grad(set_to_none=True)
            loss_of(model, data(2, step)[r]).backward()  # no worker() block: plain loop
            st = engine.finalize()
            assert st.clock == "modelled" and st.bytes_sent > 0
            res.append(grads(model))
            sgd_step(model)
        out[r] = res

    run_ranks(rank_main, 2)
    for r in range(2):
        for step in range(2):
            for a, b in zip(out[r][step], sim_grads[step]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ DDP adapter state, in-process
@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", ["none", "topk:ratio=0.3,ef=true", "powersgd:rank=2"])
def test_ddp_hook_state_averages_a_bucket_and_round_trips(spec):
    """The hook's per-bucket work (split by size, compress, exchange, write back into the flat
    buffer) on a threaded SimWorld, without DDP: it equals the engine's result for the same tensors."""
    from gradzip.engine.ddp import GradzipHookState

    shapes = [torch.Size([6, 5]), torch.Size([5]), torch.Size([7, 4]), torch.Size([])]
    world = SimWorld(2, threaded=True, timeout=30)
    grads_of = [[torch.randn(s, generator=torch.Generator().manual_seed(10 * r + i)) for i, s in enumerate(shapes)]
                for r in range(2)]
    results: dict[int, torch.Tensor] = {}
    states: dict[int, GradzipHookState] = {}

    def rank_main(r: int) -> None:
        state = states[r] = GradzipHookState(spec, world[r], min_compress_numel=10)
        buf = torch.cat([g.reshape(-1) for g in grads_of[r]])
        views = list(torch.split(buf, [s.numel() for s in shapes]))
        views = [v.view(s) for v, s in zip(views, shapes)]
        fut = torch.futures.Future()
        state._pending.append((buf, views, state.start("bucket0", buf, views), fut))
        state.drain()
        results[r] = fut.wait()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert set(results) == {0, 1}
    torch.testing.assert_close(results[0], results[1])
    # Reference: the same split by hand through the engine's exchanges on a sim world.
    from gradzip.engine.exchange import Exchange

    ref_world = SimWorld(2)
    comps = [create(spec) for _ in range(2)]
    big = [0, 2] if create(spec).name != "none" else [0, 1, 2, 3]
    small = [i for i in range(4) if i not in big]
    exs = []
    for r in range(2):
        tensors = [grads_of[r][i] for i in big]
        if create(spec).name != "powersgd":
            tensors = [torch.cat([t.reshape(-1) for t in tensors])]
        exs.append([Exchange(comps[r], ref_world[r], tensors, key="bucket0")])
        if small:
            plain = torch.cat([grads_of[r][i].reshape(-1) for i in small])
            exs[r].append(Exchange(create("none"), ref_world[r], [plain]))
    for r in range(2):
        for ex in exs[r]:
            ex.start()
    done = False
    while not done:  # waves: every rank advances exchange k before anyone advances k + 1
        done = all([exs[r][k].advance() for k in range(len(exs[0])) for r in range(2)])
    parts = exs[0][0].result()
    big_flat = torch.cat([p.reshape(-1) for p in parts])
    expected = torch.empty_like(results[0])
    offsets = [0]
    for s in shapes:
        offsets.append(offsets[-1] + s.numel())
    pos = 0
    for i in big:
        expected[offsets[i]:offsets[i + 1]] = big_flat[pos:pos + shapes[i].numel()]
        pos += shapes[i].numel()
    if small:
        small_flat = exs[0][1].result()[0].reshape(-1)
        pos = 0
        for i in small:
            expected[offsets[i]:offsets[i + 1]] = small_flat[pos:pos + shapes[i].numel()]
            pos += shapes[i].numel()
    torch.testing.assert_close(results[0], expected, rtol=1e-6, atol=1e-6)
    sd = states[0].state_dict()
    fresh = GradzipHookState(spec, world[0], min_compress_numel=10)
    fresh.load_state_dict(torch.load(_roundtrip(sd), weights_only=True))
    assert repr(fresh.compressor.state_dict()) == repr(sd["compressor"])


def _roundtrip(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("spec", ["onebit", "topk:ratio=0.1,ef=true", "signsgd"])
def test_sim_workers_share_one_one_pass_decode(spec, monkeypatch):
    """sim: the workers gather the same payloads, so one one-pass decode per bucket serves them all
    (Exchange.adopt), with the same gradients and every worker charged its decode time."""
    from gradzip.engine.exchange import Exchange

    def train(share: bool):
        torch.manual_seed(0)
        model = Net(hidden=64)
        world = SimWorld(3)
        engine = attach(model, spec, world, bucket_cap_mb=0.004, min_compress_numel=64)
        calls = []
        for w in engine._workers:
            inner = w.compressor
            orig = inner.decode_aggregate_batch
            monkeypatch.setattr(inner, "decode_aggregate_batch",
                                lambda p, c, orig=orig: calls.append(1) or orig(p, c))
        if not share:
            monkeypatch.setattr(Exchange, "adopt", lambda self, other: False)
        grads = []
        for step in range(3):
            stats = run_step(engine, model, data(3, step))
            grads.append([p.grad.clone() for p in model.parameters()])
            assert stats.compress_s > 0
        monkeypatch.undo()
        return grads, len(calls), len(engine.buckets), engine

    shared, n_shared, nb, eng = train(True)
    plain, n_plain, _, _ = train(False)
    assert n_shared >= 3 and n_plain == 3 * n_shared  # per step and bucket: once, against once per worker
    for a, b in zip(shared, plain):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(t.decode_s > 0 for t in eng.last_timings)
