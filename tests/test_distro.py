"""``distro`` (:mod:`gradzip.compress.distro`): DisTrO as Psyche ships it.

- A transcription of Psyche's arithmetic (``shared/modeling/src/distro.rs``: the FFT-built DCT bases,
  the divisor chunking, ``encode``/``decode`` einsums, ``CompressDCT::compress`` and its index widths,
  the 1-bit sign quantiser and its LSB-first packing, the scatter-mean ``decompress``,
  ``Distro::generate``'s delayed subtraction of its own previous result, and ``apply``'s inverse DCT,
  sign and SGD step) run beside the compressor on the same gradients for several steps on two
  ranks: the same indices, δ, T and decoded mean within 1e-6, the same signs, bytes and parameters.
- The byte formula, and what the engine counts.
- ``gradzip train --optimizer demo --compressor distro`` on 2 sim workers learns and resumes bit for bit.

The generic compressor tests (tests/test_compressors.py, test_properties.py, test_fastpaths.py,
test_nonfinite.py) also run on it.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from test_engine import Net, data, loss_of
from test_train import TINY, computed, losses, train_cli

from gradzip.cli import main
from gradzip.comm.sim import SimWorld
from gradzip.compress import create, dct
from gradzip.compress.quantpack import unpack_codes
from gradzip.engine import attach
from gradzip.optim import DeMo
from gradzip.training import checkpoint


# ----------------------------------------------------------------------------- Psyche, transcribed
def ref_dct(x: torch.Tensor) -> torch.Tensor:
    """TransformDCT::dct(x, ortho=true): an FFT of the even/odd reordering, along the last axis."""
    shape, n = x.shape, x.shape[-1]
    x = x.contiguous().view(-1, n)
    vc = torch.view_as_real(torch.fft.fft(torch.cat([x[:, ::2], x[:, 1::2].flip([1])], 1), dim=1))
    k = -torch.arange(n, dtype=torch.float32).unsqueeze(0) * (math.pi / (2 * n))
    v = vc[..., 0] * k.cos() - vc[..., 1] * k.sin()
    v[:, 0] /= math.sqrt(n) * 2
    v[:, 1:] /= math.sqrt(n / 2) * 2
    return (v * 2).view(shape)


def ref_idct(x: torch.Tensor) -> torch.Tensor:
    """TransformDCT::idct(x, ortho=true): an inverse real FFT, then the even/odd interleave."""
    shape, n = x.shape, x.shape[-1]
    xv = x.contiguous().view(-1, n) / 2
    xv[:, :1] *= math.sqrt(n) * 2
    xv[:, 1:] *= math.sqrt(n / 2) * 2
    k = torch.arange(n, dtype=torch.float32).unsqueeze(0) * (math.pi / (2 * n))
    w_r, w_i = k.cos(), k.sin()
    v_i_t = torch.cat([xv[:, :1] * 0.0, -xv.flip([1])[:, :n - 1]], 1)
    v_r, v_i = xv * w_r - v_i_t * w_i, xv * w_i + v_i_t * w_r
    v = torch.fft.irfft(torch.complex(v_r, v_i), n=n, dim=1)
    out = torch.zeros_like(v)
    out[:, ::2] += v[:, :n - n // 2]
    out[:, 1::2] += v.flip([1])[:, :n // 2]
    return out.view(shape)


def ref_split(n: int, close_to: int) -> int:
    """TransformDCT::get_smaller_split: walk the sorted divisors of n."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    for ix, val in enumerate(divisors):
        if val == close_to:
            return val
        if val > close_to:
            return val if ix == 0 else divisors[ix - 1]
    return n


class RefTransform:
    """TransformDCT: the bases f = dct(I) and b = idct(I) per chunk size; encode and decode."""

    def __init__(self, shapes, chunk: int) -> None:
        self.split = {s: ref_split(s, chunk) for shape in shapes for s in shape}
        sizes = set(self.split.values())
        self.f = {s: ref_dct(torch.eye(s)) for s in sizes}
        self.b = {s: ref_idct(torch.eye(s)) for s in sizes}

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 1:
            n1, n2 = self.split[x.shape[0]], self.split[x.shape[1]]
            x = x.view(x.shape[0] // n1, n1, x.shape[1] // n2, n2)
            return torch.einsum("...ijkl, jb, ld -> ...ikbd", x, self.f[n1], self.f[n2])
        n1 = self.split[x.shape[0]]
        return torch.einsum("...ij, jb -> ...ib", x.view(-1, n1), self.f[n1])

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 2:
            y = torch.einsum("...ijkl, kb, ld -> ...ibjd", x, self.b[x.shape[2]], self.b[x.shape[3]])
            return y.reshape(y.shape[0] * y.shape[1], y.shape[2] * y.shape[3])
        y = torch.einsum("...ij, jb -> ...ib", x, self.b[x.shape[1]])
        return y.reshape(-1)


def ref_compress(x: torch.Tensor, topk: int):
    """CompressDCT::compress: top-k of |x| over each chunk's h·w (or the 1-D chunk); (idx, val, xshape, totalk)."""
    xshape = x.shape
    if x.dim() > 2:
        x = x.view(xshape[0], xshape[1], xshape[2] * xshape[3])
    totalk = x.shape[-1]
    idx = x.abs().topk(max(1, min(topk, totalk)), dim=-1, largest=True, sorted=False).indices
    return idx, x.gather(-1, idx), xshape, totalk


def ref_decompress(idx, val, xshape, totalk) -> torch.Tensor:
    """CompressDCT::decompress: scatter-reduce "mean" without the zeros it starts from."""
    x = torch.zeros(xshape)
    if len(xshape) > 2:
        x = x.view(xshape[0], xshape[1], xshape[2] * xshape[3])
    return x.scatter_reduce(-1, idx, val.to(x.dtype), "mean", include_self=False).reshape(xshape)


def ref_wire(idx: torch.Tensor, val: torch.Tensor, totalk: int) -> bytes:
    """compress_idx (u8 up to 256 per chunk, u16 up to 65536, native little-endian) and the
    serialized 1-bit sign tensor (signbit, padded to 8, LSB first), one tensor after the other."""
    width = np.uint8 if totalk <= 256 else np.dtype("<u2")
    bits = torch.signbit(val).reshape(-1).to(torch.uint8)
    bits = torch.nn.functional.pad(bits, (0, (8 - bits.numel() % 8) % 8)).view(-1, 8)
    packed = (bits * torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    return idx.reshape(-1).numpy().astype(width).tobytes() + packed.numpy().tobytes()


class RefDistro:
    """Distro::generate for one rank (its δ, its previous full-precision results) and Distro::apply."""

    def __init__(self, shapes, decay: float, chunk: int, topk: int) -> None:
        self.transform, self.decay, self.topk = RefTransform(shapes, chunk), decay, topk
        self.delta = [torch.zeros(s) for s in shapes]
        self.prev: list | None = None
        self.transmit: list[torch.Tensor] = []

    def generate(self, grads, lr: float):
        out, self.transmit = [], []
        for i, g in enumerate(grads):
            if self.prev is not None:
                idx, val, xshape, totalk = self.prev[i]
                self.transmit.append(self.transform.decode(ref_decompress(idx, val, xshape, totalk)))
                self.delta[i].sub_(self.transmit[-1].view(self.delta[i].shape))
            self.delta[i].mul_(self.decay)
            self.delta[i].add_(g * lr)
            out.append(ref_compress(self.transform.encode(self.delta[i]), self.topk))
        self.prev = out
        return out

    def mean_update(self, results) -> list[torch.Tensor]:
        """apply's decode before the sign: the ranks' ±1 values concatenated, scatter-mean, inverse DCT."""
        means = []
        for i in range(len(results[0])):
            idx = torch.cat([r[i][0] for r in results], -1)
            val = torch.cat([1.0 - 2.0 * torch.signbit(r[i][1]).float() for r in results], -1)
            means.append(self.transform.decode(ref_decompress(idx, val, results[0][i][2], results[0][i][3])))
        return means


def gz_wire(payload, plans) -> list[bytes]:
    """The compressor's payload cut per tensor: its index bytes then its sign bytes."""
    codes, signs = (p.numpy().tobytes() for p in payload)
    out, a, b = [], 0, 0
    for pl in plans:
        na, nb = pl.kept * pl.bits // 8, (pl.kept + 7) // 8
        out.append(codes[a:a + na] + signs[b:b + nb])
        a, b = a + na, b + nb
    return out


SHAPES = [(128, 192), (96, 40), (300,), (10, 7), (13,)]  # 64², 48×40 (u16); 1-D 60, 10×7, a prime 13 (u8)


@pytest.mark.parametrize("topk,decay", [(8, 0.999), (3, 0.9)])
def test_equals_psyches_arithmetic_on_two_ranks(topk, decay):
    lr, ranks, steps = 0.01, 2, 4
    spec = f"distro:topk={topk},chunk=64,decay={decay}"
    comps = [create(spec) for _ in range(ranks)]
    refs = [RefDistro(SHAPES, decay, 64, topk) for _ in range(ranks)]
    theta_gz = [torch.randn(s, generator=torch.Generator().manual_seed(7 + i)) for i, s in enumerate(SHAPES)]
    theta_ref = [t.clone() for t in theta_gz]
    clear_all = [torch.ones(s, dtype=torch.bool) for s in SHAPES]  # where every step's sign was clear of 0
    prev_sent: list[list[torch.Tensor]] = []
    plans = [comps[0]._plan(s) for s in SHAPES]
    assert [pl.bits for pl in plans] == [16, 16, 8, 8, 8]
    for step in range(steps):
        grads = [[torch.randn(s, generator=torch.Generator().manual_seed(100 * step + 10 * r + i))
                  for i, s in enumerate(SHAPES)] for r in range(ranks)]
        payloads, results = [], []
        for r in range(ranks):
            payload, ctx = comps[r].compress_batch([g * lr for g in grads[r]], "b")
            res = refs[r].generate(grads[r], lr)
            payloads.append(payload)
            results.append(res)
            for i, (idx, val, _, totalk) in enumerate(res):
                # δ: the transmitted part not yet subtracted (it leaves on the next call, as in Psyche)
                torch.testing.assert_close(comps[r].state[f"b/{i}"], refs[r].delta[i].reshape(-1), rtol=0, atol=1e-6)
                if step:
                    torch.testing.assert_close(prev_sent[r][i], refs[r].transmit[i].reshape(-1), rtol=0, atol=1e-6)
                # the same coefficients chosen in every chunk (topk's order inside a chunk is unspecified)
                ours = payload_indices(payload, plans, i).view(idx.shape)
                assert torch.equal(ours.sort(-1).values, idx.sort(-1).values), (step, r, SHAPES[i])
                # ±1 exactly where a coefficient was sent, with Psyche's sign (signbit: -0.0 is negative)
                mine = comps[r].decompress_batch(payload, ctx)[i].reshape(idx.shape[:-1] + (totalk,))
                signs = 1 - 2 * torch.signbit(val).float()
                assert torch.equal(mine, torch.zeros_like(mine).scatter_(-1, idx, signs)), (step, r, SHAPES[i])
                # the bytes: Psyche's serialization of the same indices and signs, in our order
                vals_in_our_order = mine.gather(-1, ours)
                assert gz_wire(payload, plans)[i] == ref_wire(ours, vals_in_our_order, totalk)
                assert len(gz_wire(payload, plans)[i]) == comps[r].payload_bytes(SHAPES[i])
        prev_sent = [[comps[r].state[f"sent:b/{i}"].clone() for i in range(len(SHAPES))] for r in range(ranks)]
        means = comps[0].decode_aggregate_batch(payloads, ctx)
        want = refs[0].mean_update(results)
        for i, (m, w) in enumerate(zip(means, want)):
            torch.testing.assert_close(m, w.view(SHAPES[i]), rtol=0, atol=1e-6)
            clear = w.abs().view(SHAPES[i]) > 1e-5  # signs of values at rounding distance from 0 may differ
            assert torch.equal(torch.sign(m)[clear], torch.sign(w.view(SHAPES[i]))[clear])
            clear_all[i] &= clear
            theta_gz[i] -= lr * torch.sign(m)
            theta_ref[i] -= lr * torch.sign(w.view(SHAPES[i]))
    for a, b, clear in zip(theta_gz, theta_ref, clear_all):
        assert torch.equal(a[clear], b[clear]) and clear.float().mean() > 0.9


def payload_indices(payload, plans, i: int) -> torch.Tensor:
    """Tensor i's indices inside their chunks, from the payload's index bytes (int64)."""
    start = sum(pl.kept * pl.bits // 8 for pl in plans[:i])
    pl = plans[i]
    return unpack_codes(payload[0][start:start + pl.kept * pl.bits // 8], pl.kept, pl.bits).long()


def test_chunk_sides_are_psyches_largest_divisors():
    for n in (1, 7, 13, 40, 64, 96, 100, 300, 768, 3072, 30522):
        for chunk in (1, 5, 26, 64, 101):
            assert dct.largest_divisor(n, chunk) == ref_split(n, chunk), (n, chunk)
    pl = dct.divisor_plan((30522, 128), 64, 8)  # BERT's vocabulary 2·3·5087: chunks of 6 × 64
    assert (pl.regions[0].a, pl.regions[0].b, pl.kept, pl.bits) == (6, 64, 5087 * 2 * 8, 16)


# ----------------------------------------------------------------------------- bytes
def test_payload_bytes_formula_and_what_the_engine_counts():
    c = create("distro")  # Psyche's shipped settings: topk 8, chunk 64
    assert c.spec == "distro:topk=8,chunk=64,decay=0.999"
    assert c.payload_bytes((64, 64)) == 8 * 2 + 1 == 17  # u16 indices + 8 signs in one byte
    assert c.payload_bytes((768, 768)) == 144 * 8 * 2 + 144 == 2448  # 964× fewer than fp32's 2,359,296
    assert c.payload_bytes((768, 768), torch.bfloat16) == 2448  # no value travels in the gradient's dtype
    assert c.payload_bytes((30522, 128)) == 81392 * 2 + 10174
    assert c.payload_bytes((300,)) == 5 * 8 + 5 and c.payload_bytes(1000) == 20 * 8 + 20  # 1-D chunks 60, 50: u8
    assert c.payload_bytes(()) == 2 and c.payload_bytes((0,)) == 0 and c.payload_bytes((7,)) == 7 + 1
    assert c.batch_payload_bytes([(64, 64), (7,)]) == 17 + 8  # each tensor's signs padded to a byte
    torch.manual_seed(0)
    model = Net()
    engine = attach(model, "distro:topk=4,chunk=8", SimWorld(4), bucket_cap_mb=0.002, min_compress_numel=0)
    opt = DeMo(model.parameters(), lr=0.01)
    opt.configure(engine)
    for w in engine.worker_ids:
        with engine.worker(w):
            loss_of(model, data(4)[w]).backward()
    st = engine.finalize()
    payload = sum(engine.compressor.batch_payload_bytes(b.shapes, b.dtype) for b in engine.buckets)
    assert all(b.compressed for b in engine.buckets) and len(engine.buckets) > 1
    assert st.bytes_sent == st.bytes_recv == 3 * payload


def test_an_undone_step_restores_delta_and_what_was_sent():
    c = create("distro:topk=3,chunk=8,decay=0.9")
    x = [torch.randn(20, 16), torch.randn(30)]
    c.compress_batch(x, "b")
    before = c.state_dict()
    c.begin_step()
    c.compress_batch([torch.full_like(t, float("nan")) for t in x], "b")
    c.end_step(keep=False)
    assert sorted(c.state) == sorted(before["delta"]) == ["b/0", "b/1", "sent:b/0", "sent:b/1"]
    assert all(torch.equal(c.state[k], v) for k, v in before["delta"].items())
    got = c.residuals("b")  # the error memory proper: δ minus what is still to leave it
    assert got is not None
    assert all(torch.equal(m, c.state[f"b/{i}"] - c.state[f"sent:b/{i}"]) for i, m in enumerate(got))
    c.forget("b")
    assert c.state == {}


# ----------------------------------------------------------------------------- gradzip train
@pytest.fixture
def tiny(corpus) -> list[str]:
    return [*TINY, "--corpus", str(corpus), "--optimizer", "demo", "--compressor", "distro:topk=32,chunk=64"]


def test_gradzip_train_distro_learns_and_resumes_bit_for_bit(tmp_path, tiny):
    full, part = tmp_path / "full", tmp_path / "part"
    assert train_cli(*tiny, "--steps", "10", "--out", str(full)) == 0
    loss = losses(full)
    assert len(loss) == 10 and all(math.isfinite(v) for v in loss)
    assert sum(loss[-3:]) / 3 < loss[0] - 0.4, loss
    summary = json.loads((full / "summary.json").read_text())
    assert summary["spec"] == "distro:topk=32,chunk=64,decay=0.999" and summary["optimizer"] == "demo"
    assert summary["compression_ratio"] > 50  # demo at topk=32: ~15x
    assert train_cli(*tiny, "--steps", "10", "--stop-at", "3", "--out", str(part)) == 0
    assert [s for s, _ in checkpoint.list_checkpoints(part)] == [3]
    assert train_cli("--out", str(part), "--resume") == 0
    assert computed(part) == computed(full)


def test_distro_without_the_sign_step_is_one_line_exit_2(tmp_path, capsys, corpus):
    rc = main(["train", "--model", "bert-tiny", "--corpus", str(corpus), "--steps", "2", "--no-progress",
               "--compressor", "distro", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "--compressor distro needs --optimizer demo" in err
    assert not (tmp_path / "x").exists()
