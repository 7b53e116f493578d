"""``PretrainData``: batches for masked-LM + next-sentence pretraining.

Contract (what training, checkpointing and resume rely on):

- ``batch(split, step, worker, num_workers, batch_size, seed)`` is a pure function of its
  arguments. Resuming needs only the step number; runs are reproducible.
- Sharding: step ``k`` consumes a *global batch* of ``num_workers * batch_size`` examples of an
  epoch-wise permutation (seeded by ``seed`` and the epoch); worker ``w`` gets the ``w``-th slice,
  so the workers' samples within a step are disjoint. An epoch has ``num_examples // global batch``
  steps (the remainder is skipped, never duplicated). For multi-process runs pass ``worker=rank``.
- Masking (BERT): of the tokens of each row other than ``[PAD] [UNK] [CLS] [SEP] [MASK]``,
  ``round(15%)`` (at least one) are selected; of those 80% become ``[MASK]``, 10% a random
  non-special token, 10% stay. Labels hold the original ids at selected positions and -100
  elsewhere. The RNG is seeded by ``(seed, step, worker)``, so masks differ between epochs
  (dynamic masking).
- Whole-word masking (``whole_word_masking=True``, training batches only): a word is a piece and
  the ``##`` continuation pieces after it; words are taken in a random order, each one whole, while
  it fits the row's budget of ``round(15%)`` tokens (a word that would overshoot is skipped, as in
  BERT's ``create_pretraining_data.py``), so a row masks at most the budget and a few tokens fewer
  when its words do not add up to it. 80/10/10 is decided per token, as there.
- ``eval_batches(batch_size, max_batches)`` walks the held-out set in order with fixed masks: the
  same batches every call, for every run on the same corpus, tokenizer and ``seq_len``, whatever
  the seed.

Batches are dicts of int64 tensors: ``input_ids``, ``token_type_ids``, ``attention_mask``,
``labels`` (``batch, seq_len``) and ``next_sentence_label`` (``batch``; 0 = B follows A,
1 = B is random, as Hugging Face). Rows are padded to ``seq_len``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gradzip.data.corpus import Corpus, load_corpus, progress_enabled
from gradzip.data.examples import EVAL_SEED, ExampleSet, build_examples
from gradzip.data.tokenizer import WordPieceTokenizer, get_tokenizer
from gradzip.errors import GradzipError

MASK_PROB = 0.15
_SPLITS = {"train": 0, "eval": 1}
_EVAL_STREAM = 7  # separates the eval-mask RNG from the training streams


def mask_tokens(ids: np.ndarray, length: np.ndarray, rng: np.random.Generator, mask_id: int,
                special_ids: np.ndarray, vocab_size: int, prob: float = MASK_PROB,
                continuation: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """BERT masking of a ``(batch, seq)`` id array; returns ``(input_ids, labels)`` as int64.

    Exactly ``max(1, round(prob * candidates))`` positions per row are selected among the
    non-special tokens inside the row's length; 80/10/10 as in the module docstring. With
    ``continuation`` (a boolean array over the ids: the ``##`` pieces), whole words are selected
    instead, up to that many tokens (:func:`_select_words`)."""
    b, s = ids.shape
    ids = ids.astype(np.int64)
    candidate = (np.arange(s)[None, :] < length[:, None]) & ~np.isin(ids, special_ids)
    n_cand = candidate.sum(axis=1)
    n_mask = np.where(n_cand > 0, np.maximum(1, np.rint(prob * n_cand)), 0).astype(np.int64)
    # A random order of the candidates per row: the first n_mask in that order are selected.
    scores = np.where(candidate, rng.random((b, s)), 2.0)
    if continuation is None:
        ranks = np.empty((b, s), dtype=np.int64)
        np.put_along_axis(ranks, np.argsort(scores, axis=1, kind="stable"), np.arange(s)[None, :].repeat(b, 0),
                          axis=1)
        selected = ranks < n_mask[:, None]
    else:
        selected = _select_words(candidate, continuation[ids], scores, n_mask)
    labels = np.where(selected, ids, -100)
    u = rng.random((b, s))
    normal = np.setdiff1d(np.arange(vocab_size), special_ids)
    random_ids = normal[rng.integers(0, normal.size, size=(b, s))]
    out = np.where(selected & (u < 0.8), mask_id, ids)
    out = np.where(selected & (u >= 0.8) & (u < 0.9), random_ids, out)
    return out, labels


def _select_words(candidate: np.ndarray, piece: np.ndarray, scores: np.ndarray, n_mask: np.ndarray) -> np.ndarray:
    """Whole-word selection: ``(batch, seq)`` booleans. A word starts at a candidate that is not a
    continuation piece (``piece`` False), or at one whose left neighbour is no candidate (a row that
    begins inside a word); it takes the continuation candidates after it. Words go in the order of
    their first piece's score; each is taken whole while ``n_mask`` of the row's tokens allow."""
    b, s = candidate.shape
    prev = np.zeros_like(candidate)
    prev[:, 1:] = candidate[:, :-1]
    start = candidate & (~piece | ~prev)
    word = np.cumsum(start, axis=1) - 1  # the word index of each position (valid at candidates)
    selected = np.zeros((b, s), dtype=bool)
    for r in range(b):
        starts = np.flatnonzero(start[r])
        if starts.size == 0:
            continue
        sizes = np.bincount(word[r][candidate[r]], minlength=starts.size)
        taken = np.zeros(starts.size, dtype=bool)
        budget = int(n_mask[r])
        for w in np.argsort(scores[r, starts], kind="stable"):
            if budget == 0:
                break
            if sizes[w] <= budget:  # a word that would overshoot is skipped, a shorter one may still fit
                taken[w], budget = True, budget - int(sizes[w])
        selected[r] = candidate[r] & taken[np.maximum(word[r], 0)]
    return selected


@dataclass(frozen=True)
class UnigramReference:
    """Context-free reference levels of masked-LM pretraining, from the token frequencies p.

    - ``entropy`` H = −Σ p log p (nats): the loss of predicting every masked token from corpus
      frequencies alone, the "unigram plateau" training reaches first.
    - ``top_rate``: the accuracy of always guessing the most frequent token.
    - ``floor``: the loss of the best predictor that still ignores context but sees the masked
      position's *input* token. BERT's masking leaves 10% of the selected tokens unchanged and
      replaces 10% with a uniformly random token, so the input token is the label half of the time
      it is not ``[MASK]``; copying it is worth several tenths of a nat (0.44 for 512 pieces of
      the built-in corpus, 0.58 for 8,192). A model between ``floor`` and ``entropy`` has learned
      this shortcut, and only a loss below ``floor`` shows that it uses the context.
    - ``floor_acc``: that predictor's masked-token accuracy (0.8·top_rate + 0.1 + 0.1/V).

    With V the number of non-special tokens, for input x ≠ ``[MASK]`` Bayes gives
    P(y = x | x) = p_x(1 + 1/V) / (p_x + 1/V) and P(y | x) = p_y / (V p_x + 1) for y ≠ x.
    """

    entropy: float
    top_rate: float
    floor: float
    floor_acc: float

    @classmethod
    def from_counts(cls, counts: np.ndarray, normal: int) -> UnigramReference:
        """From token counts (special tokens zeroed) and V, the number of non-special tokens."""
        total = counts.sum()
        if total == 0 or normal < 1:
            nan = float("nan")
            return cls(nan, nan, nan, nan)
        p_all = counts / total
        p = p_all[counts > 0]
        entropy = float(-(p * np.log(p)).sum())
        keep = p * (1 + 1 / normal) / (p + 1 / normal)  # P(y = x | x), the input shows the label
        unchanged = float(-(p * np.log(keep)).sum())
        # random replacement x ~ uniform over the V normal tokens (zero-count ones add log 1 = 0)
        log_norm = float(np.log(normal * p + 1).sum())
        random = float((p * (-np.log(keep) + (normal - 1) * -np.log(p) + log_norm - np.log(normal * p + 1))).sum()
                       / normal)
        top = float(p.max())
        return cls(entropy, top, 0.8 * entropy + 0.1 * unchanged + 0.1 * random, 0.8 * top + 0.1 + 0.1 / normal)


class PretrainData:
    """Tokenizer + memmapped examples + deterministic masked batches. Build with :meth:`build`."""

    def __init__(self, corpus: Corpus, tokenizer: WordPieceTokenizer, train: ExampleSet, eval: ExampleSet,
                 seq_len: int, seed: int, directory: Path) -> None:
        self.corpus = corpus
        self.tokenizer = tokenizer
        self.train = train
        self.eval = eval
        self.seq_len = seq_len
        self.seed = seed
        self.directory = directory
        self.vocab_size = tokenizer.vocab_size
        self._perms: dict[tuple[str, int, int], np.ndarray] = {}
        self._continuation: np.ndarray | None = None

    @classmethod
    def build(cls, corpus: str | os.PathLike | None = None, seq_len: int = 128, vocab_size: int | None = None,
              seed: int = 0, cache_dir: str | os.PathLike | None = None, progress: bool = True,
              tokenizer: str | os.PathLike | None = None, eval_fraction: float = 0.01) -> PretrainData:
        """Load or build (and cache) everything for ``corpus`` (None = the default corpus, a path,
        or ``hf:NAME[:CONFIG[:SPLIT]]``). ``vocab_size`` (default 8192) sizes a trained WordPiece
        vocabulary; ``tokenizer`` (a vocab.txt or tokenizer.json) is used instead when given.
        ``seed`` fixes the pair segmentation of the training documents (the held-out set and its
        masks are the same for every seed)."""
        c = load_corpus(corpus, cache_dir=cache_dir, progress=progress)
        tok = get_tokenizer(c, vocab_size=vocab_size, path=tokenizer, progress=progress)
        train, eval_, directory = build_examples(c, tok, seq_len=seq_len, seed=seed, eval_fraction=eval_fraction,
                                                 progress=progress_enabled(progress))
        return cls(c, tok, train, eval_, seq_len, seed, directory)

    @property
    def num_train(self) -> int:
        return len(self.train)

    @property
    def num_eval(self) -> int:
        return len(self.eval)

    def describe(self) -> str:
        """One line for logs."""
        return (f"{self.corpus.description}: {self.corpus.num_bytes / 1e6:.1f} MB, {self.corpus.num_docs} documents; "
                f"vocab {self.vocab_size}; {self.num_train} train / {self.num_eval} eval examples of {self.seq_len}")

    def unigram_reference(self) -> UnigramReference:
        """What a model that ignores context gets on this training set (:class:`UnigramReference`)."""
        ex = self.train
        counts = np.zeros(self.vocab_size, dtype=np.int64)
        pos = np.arange(self.seq_len)[None, :]
        for start in range(0, len(ex), 4096):  # chunks keep the memmap read bounded
            ids = np.asarray(ex.ids[start:start + 4096]).astype(np.int64)
            real = pos < ex.length[start:start + 4096, None]
            counts += np.bincount(ids[real], minlength=self.vocab_size)[:self.vocab_size]
        special = np.asarray(self.tokenizer.special_ids, dtype=np.int64)
        counts[special] = 0
        return UnigramReference.from_counts(counts, int(self.vocab_size - np.unique(special).size))

    def optimal_mlm_loss(self, batch_size: int = 32, max_batches: int | None = None) -> float | None:
        """The best possible held-out loss: unknown for real text (a generated language knows it)."""
        return None

    def _set(self, split: str) -> ExampleSet:
        if split not in _SPLITS:
            raise GradzipError(f"unknown split {split!r}; use 'train' or 'eval'")
        return self.train if split == "train" else self.eval

    def _perm(self, split: str, seed: int, epoch: int, n: int) -> np.ndarray:
        key = (split, seed, epoch)
        if key not in self._perms:
            if len(self._perms) >= 4:  # consecutive steps hit the same epoch: keep a few
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = np.random.default_rng([seed, epoch, _SPLITS[split]]).permutation(n)
        return self._perms[key]

    def indices(self, split: str, step: int, worker: int, num_workers: int, batch_size: int, seed: int) -> np.ndarray:
        """Example indices of ``batch(...)`` with the same arguments (see module docstring)."""
        n = len(self._set(split))
        if step < 0 or batch_size < 1 or num_workers < 1 or not 0 <= worker < num_workers:
            raise GradzipError(f"bad batch request: step {step}, worker {worker} of {num_workers}, "
                               f"batch size {batch_size}; need step >= 0, 0 <= worker < num_workers, batch size >= 1")
        global_batch = num_workers * batch_size
        if n < global_batch:
            raise GradzipError(f"the {split} set has {n} examples, fewer than one global batch ({num_workers} "
                               f"workers x {batch_size}); use a bigger corpus or a smaller batch")
        epoch, pos = divmod(step, n // global_batch)
        start = pos * global_batch + worker * batch_size
        return self._perm(split, seed, epoch, n)[start:start + batch_size]

    def batch(self, split: str = "train", step: int = 0, worker: int = 0, num_workers: int = 1,
              batch_size: int = 32, seed: int = 0, mask_prob: float = MASK_PROB,
              whole_word_masking: bool = False) -> dict[str, torch.Tensor]:
        """The masked batch of ``worker`` at ``step`` (a pure function of the arguments).
        ``mask_prob``: the share of each row's tokens selected for prediction (BERT: 0.15; Wettig et
        al. 2023 train faster with 0.4). ``whole_word_masking``: select whole words (module
        docstring). The held-out batches always use 0.15 token by token, so that evaluations
        compare across runs and with the context-free references."""
        if not 0.0 < mask_prob < 1.0:
            raise GradzipError(f"mask_prob must be in (0, 1), got {mask_prob}")
        idx = self.indices(split, step, worker, num_workers, batch_size, seed)
        rng = np.random.default_rng([seed, step, worker, _SPLITS[split]])
        return self._make(self._set(split), idx, rng, mask_prob, self.continuation if whole_word_masking else None)

    @property
    def continuation(self) -> np.ndarray:
        """The tokenizer's continuation pieces (:meth:`WordPieceTokenizer.continuation_ids`), cached;
        a tokenizer without them is a :class:`GradzipError`, raised on first use."""
        if self._continuation is None:
            self._continuation = self.tokenizer.continuation_ids()
        return self._continuation

    def eval_batches(self, batch_size: int = 32, max_batches: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Batches over the held-out set in order, masks fixed; the last one may be smaller."""
        if batch_size < 1:
            raise GradzipError(f"eval batch size must be >= 1, got {batch_size}")
        n = len(self.eval)
        count = math.ceil(n / batch_size)
        if max_batches is not None:
            count = min(count, max(0, int(max_batches)))
        for k in range(count):
            idx = np.arange(k * batch_size, min(n, (k + 1) * batch_size))
            yield self._make(self.eval, idx, np.random.default_rng([EVAL_SEED, k, _EVAL_STREAM]))

    def _make(self, ex: ExampleSet, idx: np.ndarray, rng: np.random.Generator, mask_prob: float = MASK_PROB,
              continuation: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        order = np.argsort(idx, kind="stable")  # read the memmap in file order, then restore the order
        ids = np.empty((idx.size, self.seq_len), dtype=ex.ids.dtype)
        ids[order] = ex.ids[idx[order]]
        length = ex.length[idx].astype(np.int64)
        b_start = ex.b_start[idx].astype(np.int64)
        tok = self.tokenizer
        input_ids, labels = mask_tokens(ids, length, rng, tok.mask_id, tok.special_ids, self.vocab_size, mask_prob,
                                        continuation)
        pos = np.arange(self.seq_len)[None, :]
        attention = pos < length[:, None]
        token_types = (pos >= b_start[:, None]) & attention
        return {
            "input_ids": torch.from_numpy(input_ids),
            "token_type_ids": torch.from_numpy(token_types.astype(np.int64)),
            "attention_mask": torch.from_numpy(attention.astype(np.int64)),
            "labels": torch.from_numpy(labels),
            "next_sentence_label": torch.from_numpy(ex.nsp[idx].astype(np.int64)),
        }
