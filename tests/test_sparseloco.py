"""SparseLoCo's codec (``sparseloco``) and error feedback with decay against a transcription of the
published reference's arithmetic (CCLoco's ChunkingTransform, TopKCompressor and step: chunking by
the largest divisors, per-chunk top-k, the statistical quantiser's shift, scale and bin-mean table,
the scatter-mean over replicas, e ← β e + Δ and e ← e − decode), its exact byte formula, BERT-base's
bits per parameter, and the variable-length index code."""

from __future__ import annotations

import math

import pytest
import torch

from gradzip.compress import create, indexcode
from gradzip.compress.quantpack import code_bytes
from gradzip.errors import SpecError
from gradzip.models.bert import bert_config, parameter_shapes

SHAPES = [(128, 192), (768,), (30, 64), (7,), (96, 50)]


# ----------------------------------------------------------------------------- the reference, transcribed
def ref_split(n: int, close_to: int) -> int:
    """The reference's chunk side: walk the sorted divisors of n, the last one not above close_to."""
    divisors = sorted(d for d in range(1, n + 1) if n % d == 0)
    for ix, val in enumerate(divisors):
        if val == close_to:
            return val
        if val > close_to:
            return val if ix == 0 else divisors[ix - 1]
    return n


def ref_encode(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """'(y h) (x w) -> y x h w' for 2-D, '(x w) -> x w' for 1-D."""
    if x.dim() > 1:
        h, w = ref_split(x.shape[0], chunk), ref_split(x.shape[1], chunk)
        return x.reshape(x.shape[0] // h, h, x.shape[1] // w, w).permute(0, 2, 1, 3).contiguous()
    w = ref_split(x.shape[0], chunk)
    return x.reshape(-1, w)


def ref_decode(x: torch.Tensor) -> torch.Tensor:
    if x.dim() > 2:
        y, xx, h, w = x.shape
        return x.permute(0, 2, 1, 3).reshape(y * h, xx * w)
    return x.reshape(-1)


def ref_quantize(val: torch.Tensor, n_bins: int, range_in_sigmas: float):
    offset = n_bins // 2
    shift = val.mean()
    centered = val - shift
    std = torch.tensor(0.0) if centered.numel() <= 1 else centered.norm() / math.sqrt(centered.numel() - 1)
    scale = range_in_sigmas * std / n_bins
    if scale == 0 or torch.isnan(scale) or torch.isinf(scale):
        scale = torch.tensor(1.0)
    q = (centered.float() / scale + offset).round().clamp(0, n_bins - 1).to(torch.uint8)
    sums = torch.zeros(n_bins).scatter_add_(0, q.long().flatten(), centered.float().flatten())
    counts = torch.zeros(n_bins).scatter_add_(0, q.long().flatten(), torch.ones_like(centered.float().flatten()))
    lookup = torch.where(counts > 0, sums / counts, 0.0)
    return q, (shift, lookup)


def ref_compress(chunks: torch.Tensor, k: int, bits: int = 2, rng: float = 6):
    """Top-k per chunk (indices in the chunk), values quantised and dequantised: (idx, values, shape)."""
    flat = chunks.reshape(*chunks.shape[:-2], -1) if chunks.dim() > 2 else chunks
    k = max(1, min(k, flat.shape[-1]))
    _, idx = torch.topk(flat.abs(), k=k, dim=-1, largest=True, sorted=False)
    val = torch.gather(flat, -1, idx)
    q, (shift, lookup) = ref_quantize(val, 1 << bits, rng)
    return idx, lookup[q.long()] + shift, chunks.shape


def ref_scatter_mean(idx_list, val_list, shape) -> torch.Tensor:
    """batch_decompress: concatenate the replicas' indices and values, scatter_reduce mean."""
    x = torch.zeros(shape)
    flat = x.reshape(*shape[:-2], -1) if len(shape) > 2 else x
    flat.scatter_reduce_(-1, torch.cat(idx_list, -1), torch.cat(val_list, -1), reduce="mean", include_self=False)
    return ref_decode(flat.reshape(shape))


# ----------------------------------------------------------------------------- codec vs reference
def _mine(c, x: torch.Tensor):
    """gradzip's positions (per chunk, ascending) and decoded values of one tensor's payload."""
    payload, ctx = c.compress_batch([x], "t")
    (y, h, xx, w), r, k = c._sizes(x.shape)
    idx, _ = indexcode.decode(payload[0], r, h * w, k, c.config.index)
    dense = c.decompress_batch(payload, ctx)[0]
    blocks = dense.reshape(y, h, xx, w).transpose(1, 2).reshape(r, h * w)
    return idx, blocks.gather(1, idx), dense


@pytest.mark.parametrize("index", ["pack12", "rice"])
@pytest.mark.parametrize("shape", SHAPES)
def test_selection_quantiser_and_local_reconstruction_equal_the_reference(shape, index):
    c = create(f"sparseloco:chunk=64,k=64,bits=2,range=6,index={index}")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ridx, rval, rshape = ref_compress(ref_encode(x, 64), 64)
    idx, val, dense = _mine(c, x)
    local = ref_scatter_mean([ridx], [rval], rshape).reshape(shape)  # CCLoco's local reconstruction
    ridx, order = ridx.reshape(idx.shape).sort(1)
    assert torch.equal(idx, ridx)
    torch.testing.assert_close(val, rval.reshape(idx.shape).gather(1, order), rtol=0, atol=1e-6)
    torch.testing.assert_close(dense, local, rtol=0, atol=1e-6)


def _ref_aggregate(xs, shape, k):
    parts = [ref_compress(ref_encode(x, 64), k) for x in xs]
    return ref_scatter_mean([p[0] for p in parts], [p[1] for p in parts], parts[0][2]).reshape(shape)


@pytest.mark.parametrize("shape", SHAPES)
def test_scatter_mean_over_replicas_equals_the_reference(shape):
    g = torch.Generator().manual_seed(2)
    base = torch.randn(shape, generator=g)
    xs = [base + 0.5 * torch.randn(shape, generator=g) for _ in range(3)]  # selections overlap in part
    c = create("sparseloco:k=16")  # 1-D runs of up to 64: k < run length, so selections differ
    parts = [c.decompress_batch(*c.compress_batch([x], "t"))[0] for x in xs]
    got = c.aggregate(parts)
    torch.testing.assert_close(got, _ref_aggregate(xs, shape, 16), rtol=0, atol=1e-6)
    counts = sum((p != 0).int() for p in parts)
    if math.prod(shape) > 16:  # both shared and single-replica coordinates
        assert counts.max() == 3 and (counts == 1).any()
    mean = create("sparseloco:k=16,aggregate=mean").aggregate(parts)
    torch.testing.assert_close(mean, sum(parts) / 3, rtol=0, atol=1e-6)


def test_error_feedback_with_decay_is_sparselocos_error_update():
    """e ← β e + Δ; ĉ = Q(TopK(e)); e ← e − decode(ĉ), over four rounds, as CCLoco's step runs it."""
    beta, g = 0.95, torch.Generator().manual_seed(3)
    c = create("sparseloco:ef=true,ef_decay=0.95")
    assert c.spec == "sparseloco:chunk=64,k=64,bits=2,range=6,index=pack12,aggregate=selected,ef=true,ef_decay=0.95"
    errors = [torch.zeros(s) for s in SHAPES[:3]]
    for _ in range(4):
        deltas = [torch.randn(s, generator=g) for s in SHAPES[:3]]
        payload, ctx = c.compress_batch(deltas, "b")
        out = c.decompress_batch(payload, ctx)
        for i, d in enumerate(deltas):
            errors[i].mul_(beta).add_(d)
            ridx, rval, rshape = ref_compress(ref_encode(errors[i], 64), 64)
            sent = ref_scatter_mean([ridx], [rval], rshape).reshape(d.shape)
            errors[i].sub_(sent)
            torch.testing.assert_close(out[i], sent, rtol=0, atol=1e-6)
            torch.testing.assert_close(c.memory["b"][i], errors[i], rtol=0, atol=1e-5)


def test_decay_one_is_the_plain_error_feedback_bit_for_bit():
    g = torch.Generator().manual_seed(4)
    a, b = create("topk:ratio=0.1,ef=true"), create("topk:ratio=0.1,ef=true,ef_decay=1")
    assert a.spec == b.spec
    for _ in range(3):
        x = [torch.randn(300, generator=g)]
        out_a, out_b = (c.decompress_batch(*c.compress_batch(x, "k"))[0] for c in (a, b))
        assert torch.equal(out_a, out_b)
    assert torch.equal(a.memory["k"][0], b.memory["k"][0])


# ----------------------------------------------------------------------------- bytes
def formula(shape, chunk=64, k=64, bits=2) -> int:
    """ceil(12 m / 8) + ceil(bits m / 8) + 4 (2^bits + 1), m = chunks × min(k, chunk elements)."""
    dims = list(shape)
    a, b = (1, math.prod(dims)) if len(dims) < 2 else (dims[0], math.prod(dims[1:]))
    h = max(d for d in range(1, min(a, chunk) + 1) if a % d == 0)
    w = max(d for d in range(1, min(b, chunk) + 1) if b % d == 0)
    m = (a // h) * (b // w) * min(k, h * w)
    return code_bytes(m, 12) + code_bytes(m, bits) + 4 * ((1 << bits) + 1)


@pytest.mark.parametrize("shape", SHAPES + [(1,), (3, 4, 5), (30522, 768)])
def test_payload_bytes_equal_the_formula(shape):
    c = create("sparseloco")
    assert c.payload_bytes(shape) == formula(shape)
    if math.prod(shape) < 10 ** 6:
        payload, _ = c.compress_batch([torch.randn(shape)], "t")
        assert sum(p.numel() * p.element_size() for p in payload) == formula(shape)
    assert create("sparseloco:bits=3,k=17").payload_bytes(shape) == formula(shape, k=17, bits=3)


def test_bert_base_costs_0_219_bit_per_parameter_plus_the_tables():
    """On BERT-base's shapes (no model allocated): every weight matrix cut into whole 64×64 chunks
    sends 64 × (12 + 2) bits per 4,096 entries, 0.21875 bit per parameter, 146× less than fp32, plus
    its table. The word embeddings (30522 = 2·3·5087 rows) are cut into 6×64 chunks, so the whole
    model costs more (0.689 bit per parameter); with the vocabulary padded to 30528 (a multiple of
    64), 0.2386."""
    c = create("sparseloco")
    shapes = parameter_shapes(bert_config("bert-base"))
    total = sum(math.prod(s) for s in shapes.values())
    assert c.batch_payload_bytes(list(shapes.values())) == sum(formula(s) for s in shapes.values())
    full = {n: s for n, s in shapes.items() if len(s) == 2 and s[0] % 64 == 0 and s[1] % 64 == 0}
    numel = sum(math.prod(s) for s in full.values())
    assert numel / total > 0.78
    body = sum(c.payload_bytes(s) - 4 * 5 for s in full.values())
    assert body * 8 == numel * 0.21875 and 32 / 0.21875 == pytest.approx(146.3, abs=0.05)
    assert sum(c.payload_bytes(s) for s in full.values()) == body + 20 * len(full)  # the tables: 5 fp32 each
    everything = sum(c.payload_bytes(s) for s in shapes.values()) * 8 / total
    assert everything == pytest.approx(0.6888, abs=1e-4)
    padded = parameter_shapes(bert_config("bert-base", vocab_size=30528))
    assert sum(c.payload_bytes(s) for s in padded.values()) * 8 / sum(math.prod(s) for s in padded.values()) \
        == pytest.approx(0.2386, abs=1e-4)


def test_the_variable_length_code_is_smaller_and_decodes_exactly():
    """Rice-coded gaps (or a bitmap) on typical inputs: about 0.16 bit per parameter instead of 0.219,
    within the bound that payload_bytes declares; the same decode as 12-bit packing."""
    g = torch.Generator().manual_seed(5)
    x = [torch.randn(s, generator=g) for s in ((768, 768), (3072, 768))]
    fixed, rice = create("sparseloco"), create("sparseloco:index=rice")
    assert fixed.fixed_size and not rice.fixed_size
    pf, ctx = fixed.compress_batch(x, "t")
    pr, ctxr = rice.compress_batch(x, "t")
    numel = sum(t.numel() for t in x)
    sent = sum(p.numel() * p.element_size() for p in pr)
    assert sent <= rice.batch_payload_bytes([t.shape for t in x])
    bits = (pr[0].numel() + pr[1].numel()) * 8 / numel
    assert 0.15 < bits < 0.165 < 0.21875 == (pf[0].numel() + pf[1].numel()) * 8 / numel
    assert all(torch.equal(a, b) for a, b in zip(fixed.decompress_batch(pf, ctx), rice.decompress_batch(pr, ctxr)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_the_variable_length_code_through_the_generic_paths(dtype):
    """``index=rice`` is not in the registry's default specs that the generic tests run: the same
    checks here (shapes, dtypes, input untouched, bytes within the declared bound, the exchange of
    payloads of different sizes between two workers, the error-feedback invariant)."""
    from test_compressors import SHAPES as ANY
    from test_compressors import rand, sim, solo_single

    c = create("sparseloco:index=rice,k=8")
    for i, shape in enumerate(ANY):
        x = rand(shape, dtype, seed=i)
        keep = x.clone()
        out, sent = solo_single(c, x, key=f"s{i}")
        assert (out.shape, out.dtype) == (x.shape, dtype) and torch.equal(x, keep)
        assert sent <= c.payload_bytes(shape, dtype)
    inputs = [[rand(sh, dtype, seed=10 * w + i) for i, sh in enumerate(ANY)] for w in range(2)]
    results = sim([create("sparseloco:index=rice,k=8") for _ in range(2)], inputs)
    plain = create("sparseloco:k=8")
    for i in range(len(ANY)):
        parts = [plain.decompress_batch(*plain.compress_batch([inputs[w][i]], "t"))[0] for w in range(2)]
        assert all(torch.equal(r[i], plain.aggregate(parts)) for r in results)
    ef = create("sparseloco:index=rice,k=8,ef=true,ef_decay=0.5")
    x = [rand((64, 33), seed=1), rand((100,), seed=2)]
    out = ef.decompress_batch(*ef.compress_batch(x, "b"))
    for t, o, m in zip(x, out, ef.memory["b"]):
        torch.testing.assert_close(o + m, t, rtol=0, atol=1e-6)


@pytest.mark.parametrize("n,k", [(4096, 64), (64, 64), (384, 64), (1, 1), (4096, 4096), (4096, 1), (2112, 64)])
def test_index_codes_round_trip(n, k):
    g = torch.Generator().manual_seed(n + k)
    rows = torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(5)])
    for index in ("pack12", "rice"):
        code = indexcode.encode(rows, n, index)
        back, used = indexcode.decode(torch.cat([code, torch.ones(3, dtype=torch.uint8)]), 5, n, k, index)
        assert torch.equal(back, rows) and used == code.numel()
    assert indexcode.rice_encode(rows, n).numel() <= indexcode.rice_bound(5, n, k)
    # 12-bit packing: two positions in three bytes, the first's low byte first
    assert indexcode.pack12(torch.tensor([0xABC, 0x123])).tolist() == [0xBC, 0x3A, 0x12]


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("spec,what", [
    ("sparseloco:k=4097", "k must be in [1, chunk²] = [1, 4096]"),
    ("sparseloco:chunk=8,k=65", "k must be in [1, chunk²] = [1, 64]"),
    ("sparseloco:bits=0", "bits must be in [1, 8]"),
    ("sparseloco:bits=9", "bits must be in [1, 8]"),
    ("sparseloco:chunk=0", "chunk must be in [1, 64]"),
    ("sparseloco:index=huffman", "index must be pack12 or rice"),
    ("sparseloco:ef_decay=0.9", "add ef=true"),
    ("sparseloco:ef=true,ef_decay=1.5", "ef_decay must be in [0, 1]"),
])
def test_bad_input_is_one_line(spec, what):
    with pytest.raises(SpecError) as e:
        create(spec)
    assert what in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("sparseloco")


# ----------------------------------------------------------------------------- --sync sparseloco
def _batch(step: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + w)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def test_the_sync_mode_takes_an_outer_sgd_step_on_the_scatter_mean():
    """On SimWorld(2), one sync after H = 2 inner SGD steps: θ ← θ_global − α·aggregate, where the
    aggregate is the scatter-mean of the replicas' codes of Δ (the error memory starts at zero), by
    hand; the bytes sent are the codec's payloads, one per parameter."""
    from torch import nn

    from gradzip.comm.sim import SimWorld
    from gradzip.engine.config import EngineConfig
    from gradzip.engine.modes import SyncSettings, build_synchronizer, load_modes
    from gradzip.plan.sync import parse_sync

    load_modes()  # the mode registers its --sync spelling when its module is imported
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    start = [p.detach().clone() for p in model.parameters()]
    locals_ = []
    for w in range(2):  # each replica's inner steps, by hand
        replica = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        replica.load_state_dict(model.state_dict())
        opt = torch.optim.SGD(replica.parameters(), lr=0.1)
        for step in range(2):
            x, y = _batch(step, w)
            ((replica(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
        locals_.append([p.detach().clone() for p in replica.parameters()])
    sync_spec = parse_sync("sparseloco:every=2,alpha=0.5,k=8,beta=0.9")
    assert str(sync_spec) == ("sparseloco:every=2,alpha=0.5,aggregate=selected,beta=0.9,bits=2,chunk=64,"
                              "index=pack12,k=8,range=6")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = build_synchronizer(model, opt, SimWorld(2), SyncSettings(sync=sync_spec, engine=EngineConfig()))
    assert sync.spec == "sparseloco:chunk=64,k=8,bits=2,range=6,index=pack12,aggregate=selected,ef=true,ef_decay=0.9"
    class Stepper:  # the training loop's optimizer step, as the protocol calls it
        def step(self, clip: bool = True) -> float:
            opt.step()
            opt.zero_grad()
            return 0.0

        def skip(self) -> None:
            raise AssertionError("no step is skipped")

    sent = []
    for step in range(2):
        for w in sync.worker_ids:
            with sync.worker(w):
                x, y = _batch(step, w)
                ((model(x) - y) ** 2).mean().backward()
                sync.after_backward(Stepper())
        stats = sync.synchronize()
        sent.append(stats.bytes_sent)
        sync.commit(stats.nonfinite, Stepper())
    codec = create("sparseloco:k=8")
    for i, p in enumerate(model.parameters()):
        parts = [codec.decompress_batch(*codec.compress_batch([start[i] - loc[i]], "t"))[0] for loc in locals_]
        want = start[i] - 0.5 * codec.aggregate(parts)
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-6)
    assert sent[0] == 0 and sent[1] == codec.batch_payload_bytes([p.shape for p in model.parameters()])
    sync.detach()


def test_gradzip_train_sync_sparseloco_sends_the_formulas_bytes(tmp_path, corpus, capsys):
    """``gradzip train --sync sparseloco:every=4`` on 2 sim workers: 2 syncs in 8 steps, each sending
    (ring allgather of 2) one payload per rank: the codec's bytes summed over the model's parameters."""
    import json

    from gradzip.cli import main

    out = tmp_path / "run"
    rc = main(["train", "--model", "bert-tiny", "--seq-len", "64", "--batch-size", "4", "--workers", "2",
               "--eval-batches", "1", "--eval-every", "8", "--steps", "8", "--no-progress", "--corpus", str(corpus),
               "--sync", "sparseloco:every=4", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    s = json.loads((out / "summary.json").read_text())
    assert s["sync"] == ("sparseloco:every=4,alpha=1,aggregate=selected,beta=0.95,bits=2,chunk=64,index=pack12,"
                         "k=64,range=6")
    assert s["spec"] == "sparseloco:chunk=64,k=64,bits=2,range=6,index=pack12,aggregate=selected,ef=true,ef_decay=0.95"
    vocab = torch.load(next(out.glob("ckpt-*.pt")), weights_only=True)["shared"]["model"][
        "bert.embeddings.word_embeddings.weight"].shape[0]
    shapes = list(parameter_shapes(bert_config("bert-tiny", vocab_size=vocab)).values())
    assert sum(math.prod(sh) for sh in shapes) == s["params"]
    assert s["syncs"] == 2 and s["bytes_per_sync"] == sum(formula(sh) for sh in shapes)
    assert s["bytes_total"] == 2 * s["bytes_per_sync"]


def test_resume_between_syncs_is_bit_identical(tmp_path, corpus):
    """The error memory (nonzero after the sync at step 4) is in the checkpoint of step 5: resuming
    there gives the run's losses and bytes bit for bit."""
    from test_diloco import TINY, computed, train

    args = [*TINY, "--corpus", str(corpus), "--steps", "8", "--sync", "sparseloco:every=4,k=16",
            "--eval-every", "1"]  # (a stop evaluates)
    full, part = tmp_path / "full", tmp_path / "part"
    assert train(*args, "--out", str(full)) == 0
    assert train(*args, "--stop-at", "5", "--out", str(part)) == 0
    assert train("--out", str(part), "--resume") == 0
    assert computed(part) == computed(full)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_gloo_sends_what_sim_sends(tmp_path, corpus):
    """Two gloo processes: the same losses and bytes per step as the sim run, and a resume between
    syncs on real processes."""
    from test_diloco import TINY, _launch, records, train

    args = [*TINY, "--corpus", str(corpus), "--steps", "8", "--sync", "sparseloco:every=4"]
    assert train(*args, "--out", str(tmp_path / "sim")) == 0
    _launch("gloo", [*args, "--stop-at", "5"], tmp_path / "real")
    _launch("gloo", ["--resume"], tmp_path / "real")
    real, sim = records(tmp_path / "real"), records(tmp_path / "sim")
    assert [r["step"] for r in real] == list(range(1, 9))
    for a, b in zip(real, sim, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert (a["bytes_sent"], a["syncs"]) == (b["bytes_sent"], b["syncs"])
