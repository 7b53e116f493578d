"""``gradzip simulate``: the cost model against hand-computed cases, the compressors' bytes against
what they really put on the wire, and bad flags."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gradzip.cli import main
from gradzip.cluster import simulate as sim
from gradzip.cluster.simulate_cli import codec_for
from gradzip.compress.registry import create, registry
from gradzip.models import bert_config, num_parameters

TINY = num_parameters(bert_config("bert-tiny"))  # 1,552,898 parameters, one 25 MiB bucket with `none`


def cluster(nodes: int = 4, g: int = 1, inter: float = 1e9, intra: float = 1e10, a: float = 0.0, ai: float = 0.0,
            algorithm: str = "hierarchical", eff: float = 1.0) -> sim.Cluster:
    return sim.Cluster(nodes, g, inter, intra, a, ai, algorithm, eff)


def work(**kw) -> sim.Workload:
    return sim.Workload(**{"model": "bert-tiny", "tokens_per_second": 1000.0, "batch_size": 8, "seq_len": 64, **kw})


# ------------------------------------------------------------------------------ collectives
def test_ring_allreduce_by_hand():
    # 4 nodes x 1 GPU, 8 MB in 2 collectives, 1 Gbit/s, α = 10 µs:
    # bandwidth 2·3/4·8e6·8/1e9 = 0.096 s; latency 2 collectives · 2·3 messages · 10 µs = 120 µs.
    t = sim.allreduce_time(8e6, 2, cluster(4, 1, a=10e-6, algorithm="ring"))
    assert t == pytest.approx(0.096 + 120e-6)


def test_ring_allgather_by_hand():
    # 8 GPUs each contribute 1 MB in one allgather: 7·1e6·8/1e9 = 0.056 s + 7 · 20 µs.
    t = sim.allgather_time(1e6, 1, cluster(8, 1, a=20e-6, algorithm="ring"))
    assert t == pytest.approx(0.056 + 7 * 20e-6)


def test_hierarchical_allreduce_by_hand():
    # 2 nodes x 4 GPUs, 8 MB; NIC 1 Gbit/s shared by 4 rings; 10 Gbit/s inside:
    # intra reduce-scatter + allgather 2 · 3/4 · 8e6 · 8/1e10 = 9.6 ms;
    # inter: the NIC carries 2·(1/2)·8e6 bytes at 1 Gbit/s = 64 ms.
    t = sim.allreduce_time(8e6, 1, cluster(2, 4, 1e9, 1e10))
    assert t == pytest.approx(0.0096 + 0.064)


def test_hierarchical_allgather_by_hand():
    # 2 nodes x 4 GPUs, 1 MB each: inter (2-1)·1e6·8·4/1e9 = 32 ms; intra (4-1)·2e6·8/1e10 = 4.8 ms.
    t = sim.allgather_time(1e6, 1, cluster(2, 4, 1e9, 1e10))
    assert t == pytest.approx(0.032 + 0.0048)


def test_single_node_uses_the_intra_link():
    # 1 node x 4 GPUs, ring over NVLink-like 1e10: 2·3/4·8e6·8/1e10.
    assert sim.allreduce_time(8e6, 1, cluster(1, 4)) == pytest.approx(2 * 0.75 * 8e6 * 8 / 1e10)


@pytest.mark.parametrize("spec", ["none", "fp16", "topk:ratio=0.01,ef=true", "powersgd:rank=2"])
def test_hierarchical_equals_ring_with_one_gpu_per_node(spec):
    w = work()
    for nodes in (2, 5, 16):
        kw = dict(nodes=nodes, g=1, inter=3e8, a=30e-6)
        ring = sim.predict(spec, w, cluster(**kw, algorithm="ring"))
        hier = sim.predict(spec, w, cluster(**kw, algorithm="hierarchical"))
        assert hier.comm_s == pytest.approx(ring.comm_s, rel=1e-12) and hier.comm_s > 0


def test_link_efficiency_scales_the_bandwidth_term():
    a = sim.allreduce_time(8e6, 1, cluster(4, 1, eff=1.0))
    b = sim.allreduce_time(8e6, 1, cluster(4, 1, eff=0.5))
    assert b == pytest.approx(2 * a)


# ------------------------------------------------------------------------------ whole step
def test_step_of_none_by_hand():
    # bert-tiny with `none`: one fp32 bucket of 4·TINY bytes; 4 workers at 100 Mbit/s, α = 50 µs.
    w = work(overlap=0.0)
    p = sim.predict("none", w, cluster(4, 1, 1e8, a=50e-6))
    s = 4 * TINY
    comm = 2 * 3 / 4 * s * 8 / 1e8 + 2 * 3 * 50e-6
    compute = 8 * 64 / 1000.0
    assert p.payload_bytes == s and p.sent_bytes == 2 * 3 * s // 4 and p.collectives == 1
    assert p.compute_s == pytest.approx(compute)
    assert p.comm_s == pytest.approx(comm) and p.exposed_comm_s == pytest.approx(comm)
    assert p.step_s == pytest.approx(compute + comm)
    assert p.tokens_per_s == pytest.approx(4 * 8 * 64 / (compute + comm))
    assert p.scaling_efficiency == pytest.approx(compute / (compute + comm))
    days = sim.predict("none", w, cluster(4, 1, 1e8, a=50e-6), tokens=1e9, epochs=3).days
    assert days == pytest.approx(3e9 / p.tokens_per_s / 86400)


def test_overlap_sends_each_bucket_once_backward_has_produced_it():
    """The one overlap rule (cluster.schedule.model_step, as the sim clock): with overlap 1, bucket i
    is ready when the last micro-batch's backward has produced its share of the gradients, and the
    buckets queue on one serial link; the exposed time is what the link still needs after compute."""
    cl = cluster(4, 1, 1e8)
    w0, w1 = (work(overlap=o, accumulation=2, bucket_cap_mb=1.0) for o in (0.0, 1.0))
    p0, p1 = sim.predict("none", w0, cl), sim.predict("none", w1, cl)
    backward = 2 / 3 * p0.compute_s / 2  # the last of 2 micro-batches
    assert p1.backward_s == pytest.approx(backward)
    buckets, _ = sim.model_buckets("bert-tiny", None, 1.0, w1.min_compress_numel, False, "fp32")
    assert len(buckets) > 3
    total, done, link = sum(b.numel for b in buckets), 0, 0.0
    for b in buckets:  # the schedule, by hand
        done += b.numel
        link = max(p1.compute_s - backward * (1 - done / total), link) + sim.allreduce_time(4 * b.numel, 1, cl)
    assert p1.exposed_comm_s == pytest.approx(max(0.0, link - p1.compute_s))
    assert p0.exposed_comm_s == pytest.approx(p0.comm_s)  # no overlap: every bucket waits for backward
    assert max(0.0, p0.comm_s - backward) <= p1.exposed_comm_s < p0.exposed_comm_s
    # enough bandwidth: only the last bucket's (tiny) transfer is left after compute
    fast = sim.predict("none", w1, cluster(4, 1, 1e12))
    assert fast.exposed_comm_s < 1e-4 * fast.compute_s and fast.step_s == pytest.approx(fast.compute_s, rel=1e-4)


def test_one_worker_has_no_communication():
    p = sim.predict("topk:ratio=0.01", work(), cluster(1, 1))
    assert p.comm_s == 0.0 and p.scaling_efficiency == 1.0 and p.collectives == 0


def test_compression_cost_per_element_and_per_rank():
    codec = sim.CodecCost(encode_s=1e-9, aggregate_s=2e-9)
    ar = sim.predict("fp16", work(), cluster(4, 1), codec)
    ag = sim.predict("topk:ratio=0.01", work(), cluster(4, 1), codec)
    n_ar, n_ag = ar.detail["compressed_elements"], ag.detail["compressed_elements"]
    assert 0 < n_ar <= TINY and n_ag == n_ar
    assert ar.compress_s == pytest.approx(1e-9 * n_ar)            # allreduce: own encode/decode only
    assert ag.compress_s == pytest.approx(1e-9 * n_ag + 3 * 2e-9 * n_ag)  # + 3 other ranks' payloads


def test_powersgd_rounds_are_collectives():
    p = sim.predict("powersgd:rank=4", work(), cluster(4, 1, a=1e-3))
    q = sim.predict("powersgd:rank=4", work(), cluster(4, 1, a=0.0))
    # every collective of every round pays 2(n-1) latencies
    assert p.comm_s - q.comm_s == pytest.approx(p.collectives * 6 * 1e-3)
    assert p.collectives >= 2 * sum(b.compressed for b in sim.model_buckets("bert-tiny", None, 25.0, 1024, True)[0])


# ------------------------------------------------------------------------------ bytes of every compressor
def _spec(name: str) -> str:
    return {"topk": "topk:ratio=0.01", "randomk": "randomk:ratio=0.01", "powersgd": "powersgd:rank=2"}.get(name, name)


@pytest.mark.parametrize("name", sorted(registry()))
def test_payload_bytes_equal_what_the_compressor_sends(name):
    """The simulator's bytes per step equal the bytes of the payload tensors the compressor really
    produces for every bucket of bert-tiny (all rounds), and its own formula."""
    spec = _spec(name)
    comp = create(spec)
    p = sim.predict(spec, work(), cluster(4, 1))
    buckets, _ = sim.model_buckets("bert-tiny", None, 25.0, 1024, sim.separate_small_for(comp))
    g = torch.Generator().manual_seed(0)
    real = formula = 0
    for i, b in enumerate(buckets):
        tensors = [torch.randn(s, generator=g) for s in b.shapes]
        if not b.compressed:
            real += sum(t.numel() * 4 for t in tensors)
            formula += b.numel * 4
            continue
        payload, ctx = comp.compress_batch(tensors, f"b{i}")
        real += sum(t.numel() * t.element_size() for t in payload)
        for _ in range(1, comp.rounds):
            payload, ctx = comp.next_round_batch(tuple(t.clone() for t in payload), ctx)
            real += sum(t.numel() * t.element_size() for t in payload)
        formula += comp.batch_payload_bytes(b.shapes)
    assert p.payload_bytes == formula
    if comp.fixed_size:
        assert real == formula
        assert p.compression_ratio == pytest.approx(TINY * 4 / real)
    else:  # a data-dependent size (threshold): the formula is its upper bound, what the simulator plans for
        assert real <= formula


def engine_step(spec: str, world, hierarchical: bool = False):
    """One engine step of bert-tiny on ``world`` (sim): its StepStats."""
    from gradzip.engine import attach
    from gradzip.models import BertForPreTraining

    torch.manual_seed(0)
    model = BertForPreTraining(bert_config("bert-tiny"))
    engine = attach(model, spec, world, hierarchical=hierarchical)
    ids = torch.randint(5, 100, (2, 16))
    for w in engine.worker_ids:
        with engine.worker(w):
            out = model(ids, torch.zeros_like(ids), torch.ones_like(ids), labels=ids,
                        next_sentence_label=torch.zeros(2, dtype=torch.long))
            out.loss.backward()
    return engine.finalize()


@pytest.mark.parametrize("spec", ["none", "topk:ratio=0.01,ef=true", "onebit:exchange=twophase",
                                  "topk:ratio=0.01,ef=true,exchange=twophase",
                                  "topk:ratio=0.01,ef=true,exchange=sparse"])
def test_sent_bytes_match_the_engine(spec):
    """Bytes per rank per step equal what the engine counts on a sim world of 3 workers."""
    from gradzip.comm.sim import SimWorld

    stats = engine_step(spec, SimWorld(3, bandwidth="1gbit", latency=0))
    p = sim.predict(spec, work(), cluster(3, 1))
    assert stats.bytes_sent == p.sent_bytes
    assert p.exchange == create(spec).exchange
    if p.exchange != "allgather":  # the same alltoall, allgather and broadcast formulas on both clocks
        assert stats.link_s == pytest.approx(p.comm_s, rel=1e-6)


def test_twophase_by_hand_and_ahead_of_allgather_at_32_gpus():
    cl = cluster(8, 4)
    w = work()
    flat, two, fp16 = (sim.predict(s, w, cl) for s in ("onebit", "onebit:exchange=twophase", "fp16"))
    assert two.payload_bytes == flat.payload_bytes  # the same payload, combined differently
    assert two.comm_s < flat.comm_s / 3 and two.comm_s < fp16.comm_s / 3
    assert two.sent_bytes < 2 * two.payload_bytes < flat.sent_bytes / 10
    # One bucket by hand: alltoall of 32 chunk payloads (the NIC carries the 4 GPUs' off-node
    # chunks), then a hierarchical allgather of one chunk payload.
    comp = create("onebit:exchange=twophase")
    numel = 1 << 20
    cb = comp.payload_bytes((numel // 32,))
    timing, sent, t = sim.twophase_bucket(comp, numel, torch.float32, cl, sim.CodecCost(1e-9, 2e-9), 0.0)
    a2a = cl.inter().transfer(4 * 28 / 32 * 32 * cb, 28) + cl.intra().transfer(3 / 32 * 32 * cb, 3)
    assert timing.rounds_s[0] == pytest.approx(a2a)
    assert timing.rounds_s[1] == pytest.approx(sim.allgather_time(cb, 1, cl))
    assert sent == 31 * cb + 31 * cb and t == pytest.approx(sum(timing.rounds_s))
    assert timing.between_s == [pytest.approx(2e-9 * numel + 1e-9 * numel / 32)]


# ------------------------------------------------------------------------------ encode costs from the bench
def test_encode_cost_from_bench_json(tmp_path):
    rows = [{"name": "topk", "spec": "topk:ratio=0.01,ef=false", "numel": 1000, "time_s": 4e-6},
            {"name": "topk", "spec": "topk:ratio=0.1", "numel": 1000, "time_s": 8e-6},
            {"name": "fp16", "spec": "fp16", "numel": 2000, "compress_s": 1e-6, "decompress_s": 3e-6}]
    f = tmp_path / "bench.json"
    f.write_text(json.dumps(rows))
    c = codec_for("topk:ratio=0.1,ef=true", str(f), None)
    assert c.encode_s == pytest.approx(8e-9) and c.aggregate_s == pytest.approx(4e-9)
    c = codec_for("fp16", str(f), None)
    assert c.encode_s == pytest.approx(2e-9) and c.aggregate_s == pytest.approx(1.5e-9)
    assert codec_for("none", str(f), None).encode_s == 0.0  # nothing to encode
    c = codec_for("fp16", "3e-9", "1e-9")
    assert (c.encode_s, c.aggregate_s) == (3e-9, 1e-9)


# ------------------------------------------------------------------------------ the command
def test_cli_table_and_json(capsys):
    argv = ["simulate", "--model", "bert-large", "--nodes", "8", "--gpus-per-node", "4", "--inter-bandwidth",
            "10gbit", "--tokens-per-second", "5600", "--compressor", "none", "--compressor", "powersgd:rank=4",
            "--tokens", "16.75e9", "--epochs", "40"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "336.2 M parameters" in out and "powersgd:rank=4" in out and "days" in out
    assert main(argv + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)["results"]
    assert [r["compressor"].split(":")[0] for r in res] == ["none", "powersgd"]
    assert res[1]["payload_bytes"] < res[0]["payload_bytes"] / 50
    assert all(math.isfinite(r["days"]) and r["days"] > 0 for r in res)


@pytest.mark.parametrize("flags, needle", [
    (["--inter-bandwidth=-10gbit"], "--inter-bandwidth must be positive"),
    (["--intra-bandwidth", "0gbit"], "bandwidth must be positive"),
    (["--model", "bert-huge"], "unknown model 'bert-huge'"),
    (["--nodes", "0"], "--nodes and --gpus-per-node must be >= 1"),
    (["--compressor", "zip"], "unknown compressor 'zip'"),
    (["--overlap", "1.5"], "--overlap must be in [0, 1]"),
    (["--encode-cost", "fast"], "--encode-cost takes a JSON file"),
])
def test_bad_flags_exit_2_with_one_line(flags, needle, capsys):
    assert main(["simulate", "--tokens-per-second", "1000", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("spec", ["none", "onebit:exchange=twophase", "topk:ratio=0.01,ef=true",
                                  "topk:ratio=0.01,ef=true,exchange=sparse", "powersgd:rank=4"])
def test_hierarchical_exchange_matches_the_engine_on_two_nodes_of_two(spec):
    """Bytes (all, and those crossing nodes) and link time of gradzip simulate --hierarchical equal
    the engine's on a sim world of 2 nodes x 2 workers (same links, no latency)."""
    from gradzip.comm.sim import SimWorld

    world = SimWorld(4, bandwidth=1e9, latency=0, ranks_per_node=2, intra_bandwidth=1e10, intra_latency=0)
    stats = engine_step(spec, world, hierarchical=True)
    p = sim.predict(spec, work(hierarchical=True), cluster(2, 2))
    assert p.hierarchical and stats.bytes_sent == p.sent_bytes
    assert stats.bytes_sent - stats.intra_bytes_sent == p.inter_bytes < p.sent_bytes
    assert stats.link_s == pytest.approx(p.comm_s, rel=1e-6)


def test_hierarchical_with_one_gpu_per_node_is_the_flat_prediction():
    for spec in ("fp16", "onebit:exchange=twophase", "powersgd:rank=4"):
        flat, hier = (sim.predict(spec, work(hierarchical=h), cluster(4, 1)) for h in (False, True))
        assert (flat.sent_bytes, flat.comm_s, flat.step_s) == (hier.sent_bytes, hier.comm_s, hier.step_s)


# ------------------------------------------------------------------------------ --sync (outer modes)
SPECS = ["none", "fp16", "powersgd:rank=4", "intk:bits=8", "topk:ratio=0.01,ef=true"]


@pytest.mark.parametrize("spec", SPECS)
def test_sync_step_is_the_default(spec):
    w, cl = work(overlap=0.5, bucket_cap_mb=1.0), cluster(4, 2, a=20e-6)
    codec = sim.CodecCost(1e-9, 2e-9)
    p = sim.predict(spec, w, cl, codec)
    assert p == sim.predict(spec, w, cl, codec, sync="step") == sim.predict(spec, w, cl, codec, sync=" step ")
    assert p.sync == "step" and p.syncs_per_step == 1.0 and p.outer_s == 0.0
    assert p.bytes_per_sync == p.peak_sync_bytes == p.payload_bytes
    assert p.sync_exposed_s == pytest.approx(p.step_s - p.compute_s)
    assert p.compute_utilisation == p.scaling_efficiency == p.compute_s / p.step_s


def test_cli_sync_step_json_equals_the_default(capsys):
    argv = ["simulate", "--model", "bert-tiny", "--nodes", "2", "--gpus-per-node", "2", "--tokens-per-second", "5600",
            "--compressor", "fp16", "--compressor", "powersgd:rank=2", "--overlap", "1", "--json"]
    assert main(argv) == 0
    default = json.loads(capsys.readouterr().out)
    assert main(argv + ["--sync", "step"]) == 0
    assert json.loads(capsys.readouterr().out) == default


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("h", [1, 7, 100])
@pytest.mark.parametrize("codec", [sim.CodecCost(), sim.CodecCost(1e-9, 2e-9)], ids=["free", "codec"])
def test_diloco_sends_one_step_of_bytes_every_h_steps(spec, h, codec):
    """H inner steps of compute alone, then one exchange of the pseudo-gradient through the same
    buckets, payloads and collectives as a per-step exchange: bytes per step are the per-step
    bytes / H; a sync costs the per-step exchange's encode/decode plus its link time."""
    w, cl = work(bucket_cap_mb=1.0), cluster(4, 1, 1e8, a=50e-6)
    s = sim.predict(spec, w, cl, codec)
    d = sim.predict(spec, w, cl, codec, sync=f"diloco:every={h}")
    assert d.sync == f"diloco:every={h},outer_lr=0.7,momentum=0.9,fragments=1,delay=0"
    assert d.payload_bytes == s.payload_bytes / h
    assert d.sent_bytes == pytest.approx(s.sent_bytes / h, abs=1 / h)
    assert d.bytes_per_sync == d.peak_sync_bytes == s.payload_bytes and d.syncs_per_step == 1 / h
    assert d.collectives == pytest.approx(s.collectives / h)
    assert d.compute_s == s.compute_s and d.compression_ratio == s.compression_ratio
    assert d.sync_exposed_s == pytest.approx(s.compress_s + s.comm_s)  # no encode/link pipelining in a sync
    assert d.sync_exposed_s >= (s.step_s - s.compute_s) * (1 - 1e-12)  # per step, encoding overlaps the link
    assert d.step_s == pytest.approx(s.compute_s + (s.compress_s + s.comm_s) / h)
    assert d.step_s == pytest.approx(d.compute_s + d.compress_s + d.exposed_comm_s + d.outer_s)
    assert d.comm_s == pytest.approx(s.comm_s / h) and d.compress_s == pytest.approx(s.compress_s / h)
    assert d.compute_utilisation == pytest.approx(h * d.compute_s / (h * d.compute_s + d.sync_exposed_s))
    assert 0 < d.compute_utilisation <= 1 and d.compute_utilisation == pytest.approx(d.scaling_efficiency)
    assert d.tokens_per_s == pytest.approx(4 * w.tokens_per_step / d.step_s)
    if codec.encode_s == 0:  # nothing to pipeline: one inner step per sync is the per-step exchange
        assert d.sync_exposed_s == pytest.approx(s.step_s - s.compute_s)


def test_localsgd_costs_what_diloco_costs():
    w, cl = work(), cluster(4, 1, 1e8)
    a, b = (sim.predict("fp16", w, cl, sync=f"{m}:every=16") for m in ("localsgd", "diloco"))
    assert (a.payload_bytes, a.step_s, a.sync_exposed_s) == (b.payload_bytes, b.step_s, b.sync_exposed_s)


def test_fragments_are_contiguous_groups_of_buckets_as_the_engine_splits_them():
    from gradzip.engine import diloco

    assert diloco.split_fragments is sim.split_fragments  # one rule for the engine and the simulator
    assert sim.split_fragments([5, 5, 5, 5], 2) == [[0, 1], [2, 3]]
    assert sim.split_fragments([10, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4]]
    assert sim.split_fragments([1, 1, 1, 1, 10], 3) == [[0, 1, 2], [3], [4]]  # every group gets a bucket
    for model in ("bert-base", "bert-large"):
        buckets, params = sim.model_buckets(model, None, 25.0, 1024, True, "fp32")
        for p in (1, 2, 4, 8):
            groups = sim.split_fragments([b.numel for b in buckets], p)
            assert [i for g in groups for i in g] == list(range(len(buckets))) and all(groups)
            sizes = [sum(buckets[i].numel for i in g) for g in groups]
            assert sum(sizes) == params and max(sizes) <= params / p + max(b.numel for b in buckets)
    with pytest.raises(sim.GradzipError, match="only 2 buckets"):
        sim.split_fragments([3, 4], 3)


@pytest.mark.parametrize("spec", ["none", "fp16", "powersgd:rank=4", "intk:bits=8"])
def test_fragments_divide_the_bytes_of_one_sync(spec):
    w, cl = work(model="bert-large"), cluster(4, 1, 1e9)
    whole = sim.predict(spec, w, cl, sync="diloco:every=64")
    buckets, _ = sim.model_buckets("bert-large", None, 25.0, 1024, sim.separate_small_for(create(spec)), "fp32")
    for p in (2, 4, 8):
        f = sim.predict(spec, w, cl, sync=f"diloco:every=64,fragments={p}")
        # the same buckets in P groups: the same bytes and link time per period, in P syncs
        assert f.payload_bytes == pytest.approx(whole.payload_bytes, rel=1e-12)
        assert f.bytes_per_sync == pytest.approx(whole.bytes_per_sync / p) and f.syncs_per_step == p / 64
        assert f.comm_s == pytest.approx(whole.comm_s) and f.collectives == whole.collectives
        # the peak is the largest group's payload (exactly), about 1/P of the whole sync
        groups = sim.fragment_buckets(buckets, p)
        comp = create(spec)
        assert f.peak_sync_bytes == max(sim.exchange(comp, g, [0.0] * len(g), w, cl, sim.CodecCost()).payload
                                        for g in groups)
        assert whole.peak_sync_bytes / p <= f.peak_sync_bytes
        if spec in ("none", "fp16"):  # bytes in proportion to elements: within 5 % of 1/P
            assert f.peak_sync_bytes < 1.05 * whole.peak_sync_bytes / p


def test_delay_hides_the_link_behind_inner_steps():
    """exposed = codec + max(0, link − τ · compute) per fragment: monotone in τ, never below the
    encode/decode work, never a period shorter than H · compute."""
    w, cl, codec = work(bucket_cap_mb=1.0), cluster(4, 1, 2e7, a=50e-6), sim.CodecCost(1e-9, 0.0)
    base = sim.predict("fp16", w, cl, codec, sync="diloco:every=16")
    link, compute = base.comm_s * 16, base.compute_s
    assert base.exposed_comm_s == base.comm_s  # τ = 0: the whole link time is exposed
    assert link > 3 * compute  # a slow link: more than three inner steps of transfer
    prev = math.inf
    for tau in range(16):
        p = sim.predict("fp16", w, cl, codec, sync=f"diloco:every=16,delay={tau}")
        assert p.exposed_comm_s * 16 == pytest.approx(max(0.0, link - tau * compute))
        assert p.sync_exposed_s == pytest.approx(p.compress_s * 16 + max(0.0, link - tau * compute))
        assert p.sync_exposed_s <= prev and p.step_s >= p.compute_s and 0 < p.compute_utilisation <= 1
        assert p.comm_s == base.comm_s and p.payload_bytes == base.payload_bytes  # hidden, not removed
        prev = p.sync_exposed_s
    assert p.exposed_comm_s == 0.0 and p.sync_exposed_s == pytest.approx(p.compress_s * 16)
    # P fragments, each sent τ steps before it is applied: more delay, less exposed, never below compute
    prev = math.inf
    for tau in range(4):
        p = sim.predict("fp16", w, cl, codec, sync=f"diloco:every=16,fragments=4,delay={tau}")
        assert p.sync_exposed_s <= prev and p.step_s >= p.compute_s
        prev = p.sync_exposed_s


def test_outer_step_local_work_at_the_memory_bandwidth():
    w, cl = work(bucket_cap_mb=1.0), cluster(4, 1)
    a = sim.predict("none", w, cl, sync="diloco:every=10,fragments=2")
    b = sim.predict("none", w, cl, sync="diloco:every=10,fragments=2", memory_bps=8 * 300e9)
    assert a.outer_s == 0.0 and b.outer_s == pytest.approx(sim.OUTER_ACCESSES * 4 * TINY / 300e9 / 10)
    assert b.step_s == pytest.approx(a.step_s + b.outer_s)
    assert sim.predict("none", w, cl, memory_bps=8 * 300e9) == sim.predict("none", w, cl)  # step: in tokens/s


def test_one_worker_diloco_has_no_communication():
    p = sim.predict("fp16", work(), cluster(1, 1), sync="diloco:every=4")
    assert p.comm_s == 0.0 and p.collectives == 0 and p.compute_utilisation == 1.0


def test_cli_sync_table_and_json(capsys):
    argv = ["simulate", "--model", "bert-tiny", "--nodes", "4", "--gpus-per-node", "1", "--tokens-per-second",
            "5600", "--inter-bandwidth", "100mbit", "--compressor", "none", "--compressor", "fp16",
            "--sync", "step", "--sync", "diloco:every=100", "--memory-bandwidth", "320GB/s", "--tokens", "1e9"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["compressor", "sync", "exchange"]
    assert "util." in lines[1] and "MB/sync" in lines[1] and "sync+" in lines[1] and "days" in lines[1]
    assert [ln.split()[:2] for ln in lines[2:6]] == [["none", "step"], ["fp16", "step"],
                                                     ["none", "diloco:every=100"], ["fp16", "diloco:every=100"]]
    assert main(argv + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)["results"]
    assert [(r["compressor"], r["sync"].split(":")[0]) for r in res] == [
        ("none", "step"), ("fp16", "step"), ("none", "diloco"), ("fp16", "diloco")]
    for r in res:
        for key in ("sync", "syncs_per_step", "bytes_per_sync", "peak_sync_bytes", "sync_exposed_s", "outer_s",
                    "compute_utilisation"):
            assert key in r
        assert 0 < r["compute_utilisation"] <= 1
    assert res[2]["payload_bytes"] == res[0]["payload_bytes"] / 100 and res[2]["syncs_per_step"] == 0.01
    assert res[2]["bytes_per_sync"] == res[0]["payload_bytes"] and res[2]["outer_s"] > 0 == res[0]["outer_s"]
    assert res[2]["step_s"] < res[0]["step_s"] and res[2]["days"] < res[0]["days"]


@pytest.mark.parametrize("sync, needle", [
    ("diloco", "needs every=H"),
    ("diloco:every=0", "every=0 must be >= 1"),
    ("diloco:every=ten", "is not an integer"),
    ("diloco:every=10,fragments=3", "does not divide every=10"),
    ("diloco:every=8,fragments=2,delay=4", "delay=4 must be in [0, H/P)"),
    ("diloco:every=8,momentum=1", "momentum=1.0 must be in [0, 1)"),
    ("localsgd:every=4,outer_lr=1", "has no parameter 'outer_lr'"),
    ("sgd:every=4", "unknown --sync mode 'sgd'"),
    ("diloco:every=1000,fragments=500", "buckets; lower fragments"),
])
def test_bad_sync_exits_2_with_one_line(sync, needle, capsys):
    assert main(["simulate", "--tokens-per-second", "1000", "--model", "bert-tiny", "--sync", sync]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_bad_memory_bandwidth_exits_2(capsys):
    argv = ["simulate", "--tokens-per-second", "1000", "--sync", "diloco:every=4", "--memory-bandwidth", "fast"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--memory-bandwidth" in err and err.count("\n") == 1


# ------------------------------------------------------------------------------ --fsdp, --hsdp (sharded)
from gradzip.cluster import sharded  # noqa: E402 - the sharded model's tests, below
from gradzip.comm import cost  # noqa: E402

C4 = math.ceil(TINY / 4)  # bert-tiny in 4 shards: 388,225 elements (padded)


def test_fsdp_bytes_of_each_collective_by_hand():
    # `none`, bert-tiny (one bucket), 4 GPUs: each all-gather sends 3 shards of C4 fp32, twice per
    # step; the reduce-scatter sends 3 chunks; nothing crosses by replicas.
    p = sharded.predict_sharded("none", "fsdp", work(), cluster(2, 2))
    assert p.detail["allgather_bytes"] == 2 * 3 * C4 * 4
    assert p.detail["reduce_scatter_bytes"] == 3 * C4 * 4 == cost.reduce_scatter_bytes(4 * C4 * 4, 4)
    assert p.detail["replica_allreduce_bytes"] == 0
    assert p.sent_bytes == p.inter_bytes == 9 * C4 * 4
    assert p.payload_bytes == 4 * C4 * 4 and p.collectives == 3 and p.exchange == "rs"
    # accumulation: every micro-batch gathers, the gradient is reduced once per step
    acc = sharded.predict_sharded("none", "fsdp", work(accumulation=3), cluster(2, 2))
    assert acc.detail["allgather_bytes"] == 3 * 2 * 3 * C4 * 4 and acc.detail["reduce_scatter_bytes"] == 3 * C4 * 4
    assert acc.sent_bytes == acc.inter_bytes == (18 + 3) * C4 * 4
    # one node: nothing crosses nodes
    assert sharded.predict_sharded("none", "fsdp", work(), cluster(1, 4)).inter_bytes == 0


@pytest.mark.parametrize("spec, scheme", [("fp16", "rs"), ("randomk:ratio=0.01", "rs"),
                                          ("topk:ratio=0.01,ef=true", "alltoall"), ("onebit", "alltoall")])
def test_fsdp_compresses_the_reduce_scatter(spec, scheme):
    comp = create(spec)
    buckets, _ = sim.model_buckets("bert-tiny", None, 25.0, 1024, True)
    n = 8
    chunks = [math.ceil(b.numel / n) for b in buckets]
    want = sum((n - 1) * (comp.payload_bytes((c,)) if b.compressed else c * 4) for b, c in zip(buckets, chunks))
    p = sharded.predict_sharded(spec, "fsdp", work(), cluster(4, 2))
    assert p.exchange == scheme and p.detail["reduce_scatter_bytes"] == want
    assert p.detail["allgather_bytes"] == sum(2 * (n - 1) * c * 4 for c in chunks)


def test_fsdp_runs_compressors_that_are_not_chunkable_through_their_own_exchange():
    # PowerSGD on each parameter's block of rows in every GPU's chunk: an allreduce of P and Q of
    # every block; threshold: its allgather of every chunk's payload.
    comp = create("powersgd:rank=4")
    buckets, _ = sim.model_buckets("bert-tiny", None, 25.0, 1024, True)
    n = 8
    p = sharded.predict_sharded("powersgd:rank=4", "fsdp", work(), cluster(4, 2))
    blocks = [sharded.row_blocks(b.shapes, n) * n for b in buckets]
    want = sum(cost.allreduce_bytes(comp.batch_payload_bytes(bl), n) if b.compressed
               else (n - 1) * math.ceil(b.numel / n) * 4 for b, bl in zip(buckets, blocks))
    assert p.exchange == "allreduce" and p.detail["reduce_scatter_bytes"] == pytest.approx(want)
    assert p.detail["reduce_scatter_bytes"] < sharded.predict_sharded("none", "fsdp", work(), cluster(4, 2)).detail[
        "reduce_scatter_bytes"] / 4
    assert sharded.predict_sharded("threshold", "fsdp", work(), cluster(4, 2)).exchange == "allgather"
    # HSDP: PowerSGD of each parameter's shard across the replicas
    h = sharded.predict_sharded("powersgd:rank=4", "hsdp", work(), cluster(4, 2))
    assert 0 < h.detail["replica_allreduce_bytes"] < sharded.predict_sharded("none", "hsdp", work(), cluster(4, 2)
                                                                              ).detail["replica_allreduce_bytes"] / 10


def test_fsdp_step_by_hand():
    # 4 nodes x 1 GPU, 1 Gbit/s, no latency, overlap 0: the first forward gather and the first
    # backward gather stall compute (one unit: nothing to prefetch behind); the reduce-scatter
    # ((n-1)/n of 4 shards) then takes as long as a gather; compute 0.512 s.
    ag = 3 * C4 * 4 * 8 / 1e9
    p = sharded.predict_sharded("none", "fsdp", work(), cluster(4, 1, algorithm="ring"))
    assert p.comm_s == pytest.approx(3 * ag) and p.exposed_comm_s == pytest.approx(3 * ag)
    assert p.step_s == pytest.approx(0.512 + 3 * ag) and p.detail["gather_stall_s"] == pytest.approx(2 * ag)


def test_hsdp_none_crosses_nodes_as_the_ring_allreduce_of_a_shard():
    nodes, g = 4, 2
    c = math.ceil(TINY / g)
    p = sharded.predict_sharded("none", "hsdp", work(), cluster(nodes, g, a=10e-6))
    assert p.inter_bytes == p.detail["replica_allreduce_bytes"] == cost.allreduce_bytes(c * 4, nodes)
    assert p.detail["allgather_bytes"] == 2 * (g - 1) * c * 4
    assert p.detail["reduce_scatter_bytes"] == cost.reduce_scatter_bytes(g * c * 4, g)
    # the replica ring runs at the NIC's share of each of the g groups
    unit = sharded.hsdp_unit(create("none"), sim.model_buckets("bert-tiny", None, 25.0, 1024, False)[0][0],
                             torch.float32, cluster(nodes, g, a=10e-6), sim.CodecCost())
    assert unit.reduce.rounds_s[1] == pytest.approx(cost.allreduce_time(c * 4, nodes, cost.Link(1e9 / g, 10e-6)))


def test_memory_by_hand():
    w, cl = work(), cluster(2, 4)
    none, topk = create("none"), create("topk:ratio=0.01,ef=true")
    assert sharded.memory("ddp", none, w, cl) == sharded.Memory(TINY * 4, TINY * 4, TINY * 8, 0)
    assert sharded.memory("ddp", topk, w, cl).error == 1548288 * 4  # the compressed bucket, fp32
    c8, c4 = math.ceil(TINY / 8), math.ceil(TINY / 4)
    assert sharded.memory("fsdp", none, w, cl) == sharded.Memory(c8 * 4, c8 * 4, c8 * 8, 0)
    assert sharded.memory("hsdp", none, w, cl) == sharded.Memory(c4 * 4, c4 * 4, c4 * 8, 0)
    # EF: the reduce-scatter input (the whole padded unit) for FSDP, the node's shard for HSDP
    assert sharded.memory("fsdp", topk, w, cl).error == 8 * math.ceil(1548288 / 8) * 4
    assert sharded.memory("hsdp", topk, w, cl).error == math.ceil(1548288 / 4) * 4
    half = sharded.memory("fsdp", none, work(grad_dtype="bf16"), cl)
    assert half.grads == c8 * 2 and half.params == c8 * 4
    # accumulating, the gradient stays unsharded until the last micro-batch
    assert sharded.memory("fsdp", none, work(accumulation=2), cl).grads == TINY * 4


SHARDED = ["simulate", "--model", "bert-tiny", "--tokens-per-second", "1000", "--batch-size", "8", "--seq-len", "64"]


@pytest.mark.parametrize("flags, needle", [
    (["--fsdp", "--hsdp"], "--fsdp and --hsdp"),
    (["--hsdp", "--gpus-per-node", "1"], "--hsdp shards inside each node"),
    (["--hsdp", "--nodes", "1"], "--hsdp replicates across nodes"),
    (["--fsdp", "--sync", "diloco:every=10"], "cannot be combined with --sync"),
    (["--hsdp", "--sync", "localsgd:every=4"], "cannot be combined with --sync"),
    (["--fsdp", "--hierarchical"], "--hierarchical"),
    (["--fsdp", "--memory-bandwidth", "320GB/s"], "--memory-bandwidth is for --sync"),
])
def test_bad_sharded_combinations_exit_2_with_one_line(flags, needle, capsys):
    assert main(SHARDED + flags) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_sharded_table_puts_ddp_beside_the_mode(capsys):
    assert main(SHARDED + ["--nodes", "2", "--gpus-per-node", "2", "--hsdp", "--compressor", "fp16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["compressor", "mode", "exchange", "sent_MB", "inter_MB", "compute", "compress", "comm",
                                "exposed", "step", "tokens/s", "eff.", "params", "grads", "optim", "EF"]
    assert [ln.split()[:2] for ln in lines[2:4]] == [["fp16", "ddp"], ["fp16", "hsdp"]]
    ddp = sim.predict("fp16", work(), cluster(2, 2, 1e10, 1e11, 50e-6, 5e-6))
    assert f"{ddp.step_s * 1e3:.0f}ms" in lines[2].split()
    assert main(SHARDED + ["--fsdp", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["results"]
    assert [r["mode"] for r in res] == ["ddp", "fsdp"]
    assert res[1]["memory_bytes"]["params"] < res[0]["memory_bytes"]["params"]


def test_default_output_is_unchanged(capsys):
    """Without --fsdp/--hsdp the table is the one gradzip simulate always printed."""
    assert main(SHARDED + ["--nodes", "4", "--gpus-per-node", "1", "--inter-bandwidth", "1gbit"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "bert-tiny: 1.6 M parameters; 4 nodes x 1 GPUs = 4 workers; 1gbit between nodes, 100gbit inside; "
        "hierarchical collectives; 512 tokens per GPU per step at 1000 tokens/s",
        "compressor    exchange   MB/GPU   ratio  compute  compress     comm  exposed     step   tokens/s   eff.",
        "none         allreduce     6.21    1.0x    512ms       0ms     75ms     75ms    587ms      3,490   87%",
    ]
