"""Error feedback with a low-precision memory (``ErrorFeedback(memory_dtype=...)``, what
``fsdp_compress(ef_dtype=torch.bfloat16)`` and ``gradzip train --ef-dtype bf16`` build): the
arithmetic of the fp32 path rounded once per step into the stored memory, two buffers of that
dtype and no copy per step, and exact undo of a skipped step."""

from __future__ import annotations

import pytest
import torch

from gradzip.compress import create
from gradzip.compress.ef import ErrorFeedback
from gradzip.engine.fsdp import _build

SPECS = ["topk:ratio=0.25", "onebit", "qsgd", "fp16"]


def grads(steps: int, dtype: torch.dtype, n: int = 64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(n, generator=g).to(dtype) for _ in range(steps)]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mem_dtype", [torch.bfloat16, torch.float16])
def test_each_step_is_the_fp32_step_rounded_into_the_memory(spec: str, grad_dtype, mem_dtype) -> None:
    """compensated = g + memory in fp32; the payload of it; memory = (compensated - sent) rounded."""
    ef = ErrorFeedback(create(spec), memory_dtype=mem_dtype)
    ref_inner, mem = create(spec), torch.zeros(64, dtype=mem_dtype)
    torch.manual_seed(0)
    for g in grads(4, grad_dtype):
        state = torch.get_rng_state()
        payload, ctx = ef.compress_batch([g], "k")
        torch.set_rng_state(state)  # qsgd draws: the reference draws the same numbers
        compensated = g.float() + mem.float()
        want, rctx = ref_inner.compress_batch([compensated], "k")
        assert all(torch.equal(a, b) for a, b in zip(payload, want))
        mem = (compensated - ref_inner.decompress_batch(want, rctx)[0]).to(mem_dtype)
        assert torch.equal(ef.residuals("k")[0], mem) and ef.residuals("k")[0].dtype == mem_dtype
        out = ef.decompress_batch(payload, ctx)[0]
        assert out.dtype == grad_dtype


def test_steps_reuse_two_buffers_and_copy_nothing(monkeypatch) -> None:
    """A step writes its residual into the second buffer and keeping it swaps the two: the memory's
    storage alternates between two buffers, and no step snapshots the state (no state_dict)."""
    ef = ErrorFeedback(create("topk:ratio=0.25"), memory_dtype=torch.bfloat16)
    ef.compress_batch([torch.ones(64)], "k")  # the memory exists before the first step
    monkeypatch.setattr(ef, "state_dict", lambda: pytest.fail("a step copied the memory"))
    ptrs = []
    for g in grads(6, torch.float32):
        ef.begin_step()
        ef.compress_batch([g], "k")
        ef.end_step(keep=True)
        ptrs.append(ef.residuals("k")[0].untyped_storage().data_ptr())
    assert len(set(ptrs)) == 2 and ptrs[0::2] == [ptrs[0]] * 3 and ptrs[1::2] == [ptrs[1]] * 3
    assert ef.residuals("k")[0].untyped_storage().nbytes() == 2 * 64  # bf16: half of fp32's bytes


def test_a_skipped_step_leaves_the_memory_as_it_was() -> None:
    """end_step(keep=False): the memory is bit for bit (and buffer for buffer) what it was, and the
    next step is the step a run that never saw the skipped one takes."""
    ef = ErrorFeedback(create("onebit"), memory_dtype=torch.bfloat16)
    twin = ErrorFeedback(create("onebit"), memory_dtype=torch.bfloat16)
    g0, g1, g2 = grads(3, torch.float32)
    for e in (ef, twin):
        e.begin_step()
        e.compress_batch([g0], "k")
        e.end_step(keep=True)
    before = ef.residuals("k")[0]
    saved, ptr = before.clone(), before.data_ptr()
    ef.begin_step()
    ef.compress_batch([g1 * 1e3], "k")  # e.g. a step some rank saw overflow
    ef.end_step(keep=False)
    assert torch.equal(ef.residuals("k")[0], saved) and ef.residuals("k")[0].data_ptr() == ptr
    for e in (ef, twin):
        e.begin_step()
    got, want = ef.compress_batch([g2], "k")[0], twin.compress_batch([g2], "k")[0]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    ef.end_step(keep=True)
    twin.end_step(keep=True)
    assert torch.equal(ef.residuals("k")[0], twin.residuals("k")[0])


def test_a_non_finite_gradient_leaves_a_finite_memory() -> None:
    ef = ErrorFeedback(create("topk:ratio=0.25"), memory_dtype=torch.bfloat16)
    g = torch.randn(64)
    g[3] = float("inf")
    ef.compress_batch([g], "k")
    assert torch.isfinite(ef.residuals("k")[0]).all()


def test_checkpoints_keep_the_dtype_and_load_a_flat_memory() -> None:
    ef = ErrorFeedback(create("topk:ratio=0.25"), memory_dtype=torch.bfloat16)
    ef.compress_batch([torch.randn(64)], "k")
    sd = ef.state_dict()
    other = ErrorFeedback(create("topk:ratio=0.25"), memory_dtype=torch.bfloat16)
    other.load_state_dict(sd)
    assert torch.equal(other.residuals("k")[0], ef.residuals("k")[0])
    # the earlier low-precision memory saved one flat tensor per key: it loads as that key's memory
    other.load_state_dict({"inner": sd["inner"], "memory": {"k": sd["memory"]["k"][0].float()}})
    assert other.residuals("k")[0].dtype == torch.bfloat16
    assert torch.equal(other.residuals("k")[0], ef.residuals("k")[0])


def test_fsdp_ef_dtype_builds_it() -> None:
    comp = _build("topk:ratio=0.1,ef=true", torch.bfloat16)
    assert isinstance(comp, ErrorFeedback) and comp.memory_dtype == torch.bfloat16
    assert comp.spec == create("topk:ratio=0.1,ef=true").spec
    assert _build("topk:ratio=0.1,ef=true", torch.float32).memory_dtype == torch.float32
    with pytest.raises(ValueError, match="memory_dtype must be a floating dtype"):
        ErrorFeedback(create("topk:ratio=0.1"), memory_dtype=torch.int8)
