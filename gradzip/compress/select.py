"""Exact top-k-by-magnitude selection, fast on large CPU tensors.

``torch.topk`` on a CPU is a full selection over all n elements (~35x a memcpy for k = 1% of 2^24,
see ``gradzip bench compress``). :func:`topk_indices` returns exactly the same set of magnitudes:

1. Keys: the float's bits with the sign bit cleared, viewed as an integer of the same width. They
   order like ``|x|`` (NaN above inf, as ``torch.topk`` ranks NaN), for fp32, fp16, bf16 and fp64.
2. Threshold: the r-th largest key of a random sample of ``sample`` keys, with r chosen so that
   about 1.3 k + 4 standard deviations (+4) of elements lie above it, so that the threshold is
   almost never above the true k-th largest key.
3. Candidates: one pass over the keys, in cache-sized chunks, collects the indices with key >=
   threshold (~1.5 k of them).
4. If fewer than k candidates came back (rare), lower the threshold (r x 4) and redo step 3; once r
   reaches the sample size, select over all elements instead.
5. Exact selection among the candidates: the k-th largest key ``kth`` (numpy introselect), all keys
   > kth, then the lowest-index keys == kth until there are exactly k.

Every element that is not a candidate has a key below the threshold, hence below all k selected, so
the selection is exact. Ties are broken by lowest index, so results are deterministic. Indices come
back as ascending ``int32``. Small tensors, large ratios (k > n/8) and non-CPU devices skip the
sampling (the GPU's ``torch.topk`` is fast).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from gradzip.compress import native
from gradzip.compress.bitpack import INT_VIEW, empty

_CHUNK = 1 << 16  # elements per pass of step 3: the temporaries stay in the L2 cache


def topk_indices(x: Tensor, k: int, sample: int = 1 << 16, seed: int = 0) -> Tensor:
    """Ascending int32 indices of ``k`` elements of largest ``|x|`` in ``x`` (read flat)."""
    flat = x.detach().reshape(-1)
    n = flat.numel()
    if n >= 2**31:
        raise ValueError(f"top-k indices are int32: tensors must have < 2^31 elements, got {n}")
    k = max(0, min(int(k), n))
    if k == 0 or k == n:
        return torch.arange(k, dtype=torch.int32, device=flat.device)
    iv = flat.view(INT_VIEW[flat.dtype])
    mask = torch.iinfo(iv.dtype).max
    if iv.device.type != "cpu":
        return _topk_torch(iv, k)
    keys = iv.numpy()
    cand: np.ndarray | None = None
    if n > 4 * sample and 8 * k <= n:
        rng = np.random.default_rng(seed)
        sk = keys[rng.integers(0, n, sample)] & mask
        expect = sample * k / n
        r = math.ceil(1.3 * expect + 4.0 * math.sqrt(expect) + 4.0)
        while r < sample:
            thr = np.partition(sk, sample - r)[sample - r]  # the r-th largest sampled key
            cand = _at_least(keys, thr, mask)
            if cand.size >= k:
                break
            cand, r = None, 4 * r
    if cand is None:
        ck = keys & mask
    else:
        ck = keys[cand] & mask
    pos = _exact(ck, k)
    idx = pos if cand is None else cand[pos]
    return torch.from_numpy(idx.astype(np.int32))


def _topk_torch(iv: Tensor, k: int) -> Tensor:
    """Off the CPU: ``torch.topk`` of the keys (fast on a GPU), indices ascending."""
    keys = iv & torch.iinfo(iv.dtype).max
    return torch.topk(keys, k, sorted=False).indices.sort().values.to(torch.int32)


def _at_least(keys: np.ndarray, thr: np.integer, mask: int) -> np.ndarray:
    """Ascending indices i with ``keys[i] & mask >= thr``: one fused pass for fp32 keys (the C
    kernel, see ``native``), else numpy one chunk at a time."""
    if keys.dtype == np.int32:
        idx = native.at_least(torch.from_numpy(keys), int(thr))
        if idx is not None:
            return idx.numpy()
    tmp = np.empty(min(_CHUNK, keys.size), dtype=keys.dtype)
    hit = np.empty(tmp.size, dtype=np.bool_)
    parts = []
    for start in range(0, keys.size, _CHUNK):
        c = keys[start:start + _CHUNK]
        m = c.size
        np.bitwise_and(c, mask, out=tmp[:m])
        np.greater_equal(tmp[:m], thr, out=hit[:m])
        parts.append(np.flatnonzero(hit[:m]) + start)
    return np.concatenate(parts)


def _exact(ck: np.ndarray, k: int) -> np.ndarray:
    """Ascending positions of the k largest of ``ck``; ties at the k-th value go to the lowest positions."""
    kth = np.partition(ck, ck.size - k)[ck.size - k]
    sel = ck > kth
    need = k - int(np.count_nonzero(sel))
    if need > 0:
        sel[np.flatnonzero(ck == kth)[:need]] = True
    return np.flatnonzero(sel)


def sparse_to_dense(values: Tensor, indices: Tensor, n: int) -> Tensor:
    """A new 1-D tensor of ``n`` zeros with ``values`` written at ``indices`` (int32 or int64)."""
    out = empty(n, values.dtype, values.device, zero=True)
    if indices.numel():
        out[indices] = values
    return out
