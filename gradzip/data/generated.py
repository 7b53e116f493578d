"""``GeneratedData``: masked-LM batches of a generated language whose optimum is exact.

The calibrated bench tier (``--corpus hmm[:options]``, see :mod:`gradzip.data.hmm`). It keeps
:class:`~gradzip.data.pretrain.PretrainData`'s contract where training relies on it:

- ``batch(split, step, worker, num_workers, batch_size, seed, mask_prob)`` is a pure function of
  its arguments: the language seed, the run's seed, the step and the worker seed the sampling, so
  every compressor run with the same seed sees the same sequences and masks (paired runs). The
  training stream is fresh samples of the language, never repeated.
- Rows are ``[CLS] w_1 .. w_L [SEP]`` with ``L = seq_len - 2``, all full length, one segment, no
  next-sentence label (the objective is masked LM alone).
- Masking selects ``max(1, round(p·L))`` positions per row and shows ``[MASK]`` at every one of
  them (no random or unchanged tokens), so the Bayes-optimal prediction of a masked word is the
  HMM's posterior given the unmasked ones, computed exactly by forward-backward.
- ``eval_batches(batch_size, max_batches)`` walks a fixed held-out set with fixed masks at 15%;
  :meth:`optimal_mlm_loss` is the Bayes-optimal loss on exactly those batches, averaged as the
  evaluation averages (the mean of per-batch means), so ``eval_mlm_loss - optimal_mlm_loss`` is
  the model's excess loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

import numpy as np
import torch
from tokenizers import Tokenizer, models

from gradzip.data.hmm import HMMLanguage, HMMSpec, entropy, is_generated  # noqa: F401 (re-exported)
from gradzip.data.pretrain import MASK_PROB, UnigramReference, mask_tokens
from gradzip.data.tokenizer import SPECIAL_TOKENS, WordPieceTokenizer, _bert_pipeline
from gradzip.errors import GradzipError

EVAL_ROWS = 4096  # the held-out set: more rows than any evaluation reads
_SPLITS = {"train": 0, "eval": 1}


def word_tokenizer(words: int) -> WordPieceTokenizer:
    """BERT's pipeline over the vocabulary ``[PAD] [UNK] [CLS] [SEP] [MASK] w0 .. w{words-1}``: the
    text ``"w3 w17"`` encodes to the ids of words 3 and 17, so exports and fine-tuning read it."""
    vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + [f"w{k}" for k in range(words)])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", continuing_subword_prefix="##"))
    _bert_pipeline(tok, lowercase=True)
    return WordPieceTokenizer(tok, f"generated vocabulary of {words} words")


class GeneratedData:
    """Batches of an :class:`HMMLanguage`. Build with :meth:`build`."""

    def __init__(self, spec: HMMSpec, seq_len: int) -> None:
        if seq_len < 4:
            raise GradzipError(f"seq_len must be >= 4 for a generated language, got {seq_len}")
        self.spec = spec
        self.language = HMMLanguage.generate(spec)
        self.tokenizer = word_tokenizer(spec.words)
        self.vocab_size = self.tokenizer.vocab_size
        self.seq_len = seq_len
        self.length = seq_len - 2
        self._offset = len(SPECIAL_TOKENS)  # word k has token id k + offset
        self._eval_words, self._eval_masked = _held_out(spec, self.length)

    @classmethod
    def build(cls, corpus: str, seq_len: int = 128, vocab_size: int | None = None, **_: object) -> GeneratedData:
        """``corpus``: ``hmm[:options]``. ``vocab_size``, when given, must be the language's
        (words + 5 special tokens)."""
        data = cls(HMMSpec.parse(corpus), seq_len)
        if vocab_size is not None and vocab_size != data.vocab_size:
            raise GradzipError(f"--vocab-size {vocab_size} does not match {corpus}: its vocabulary is "
                               f"{data.vocab_size} ({data.spec.words} words + {len(SPECIAL_TOKENS)} special tokens); "
                               f"leave --vocab-size unset or set words= in the spec")
        return data

    @property
    def num_train(self) -> int:
        return 0  # an endless stream

    @property
    def num_eval(self) -> int:
        return EVAL_ROWS

    def describe(self) -> str:
        return (f"generated language {self.spec}: vocab {self.vocab_size}; fresh training samples, "
                f"{EVAL_ROWS} eval rows of {self.seq_len}")

    def unigram_reference(self) -> UnigramReference:
        """With ``[MASK]``-only corruption the context-free floor is the unigram entropy itself."""
        p = self.language.unigram()
        h, top = entropy(p), float(p.max())
        return UnigramReference(h, top, h, top)

    def batch(self, split: str = "train", step: int = 0, worker: int = 0, num_workers: int = 1,
              batch_size: int = 32, seed: int = 0, mask_prob: float = MASK_PROB,
              whole_word_masking: bool = False) -> dict[str, torch.Tensor]:
        """The masked batch of ``worker`` at ``step`` (see the module docstring). Whole-word masking
        does not apply: every word of the language is one token."""
        if whole_word_masking:
            raise GradzipError("whole-word masking needs word pieces; a generated language has one token per word")
        if split not in _SPLITS:
            raise GradzipError(f"unknown split {split!r}; use 'train' or 'eval'")
        if step < 0 or batch_size < 1 or num_workers < 1 or not 0 <= worker < num_workers:
            raise GradzipError(f"bad batch request: step {step}, worker {worker} of {num_workers}, "
                               f"batch size {batch_size}; need step >= 0, 0 <= worker < num_workers, batch size >= 1")
        if not 0.0 < mask_prob < 1.0:
            raise GradzipError(f"mask_prob must be in (0, 1), got {mask_prob}")
        rng = np.random.default_rng([self.spec.seed, seed, step, worker, _SPLITS[split]])
        words = self.language.sample(batch_size, self.length, rng)
        return self._make(words, _select(batch_size, self.length, mask_prob, rng))

    def eval_batches(self, batch_size: int = 32, max_batches: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        for lo, hi in self._eval_spans(batch_size, max_batches):
            yield self._make(self._eval_words[lo:hi], self._eval_masked[lo:hi])

    def optimal_mlm_loss(self, batch_size: int = 32, max_batches: int | None = None) -> float:
        """The Bayes-optimal masked-LM loss of ``eval_batches(batch_size, max_batches)``."""
        per_row = self._eval_row_losses()
        means = [np.concatenate(per_row[lo:hi]).mean() for lo, hi in self._eval_spans(batch_size, max_batches)]
        return float(np.mean(means)) if means else float("nan")

    def _eval_spans(self, batch_size: int, max_batches: int | None) -> list[tuple[int, int]]:
        if batch_size < 1:
            raise GradzipError(f"eval batch size must be >= 1, got {batch_size}")
        count = -(-EVAL_ROWS // batch_size)
        if max_batches is not None:
            count = min(count, max(0, int(max_batches)))
        return [(k * batch_size, min(EVAL_ROWS, (k + 1) * batch_size)) for k in range(count)]

    def _eval_row_losses(self) -> list[np.ndarray]:
        return _row_losses(self.spec, self.length)

    def _make(self, words: np.ndarray, masked: np.ndarray) -> dict[str, torch.Tensor]:
        tok = self.tokenizer
        n = words.shape[0]
        ids = np.concatenate([np.full((n, 1), tok.cls_id), words + self._offset, np.full((n, 1), tok.sep_id)], axis=1)
        sel = np.concatenate([np.zeros((n, 1), bool), masked, np.zeros((n, 1), bool)], axis=1)
        return {
            "input_ids": torch.from_numpy(np.where(sel, tok.mask_id, ids).astype(np.int64)),
            "token_type_ids": torch.zeros((n, self.seq_len), dtype=torch.int64),
            "attention_mask": torch.ones((n, self.seq_len), dtype=torch.int64),
            "labels": torch.from_numpy(np.where(sel, ids, -100).astype(np.int64)),
        }


def _select(rows: int, length: int, prob: float, rng: np.random.Generator) -> np.ndarray:
    """``max(1, round(prob·length))`` masked positions per row, uniformly at random (BERT's
    selection, :func:`gradzip.data.pretrain.mask_tokens`, with every selected token masked)."""
    ids = np.zeros((rows, length), dtype=np.int64)
    _, labels = mask_tokens(ids, np.full(rows, length), rng, mask_id=0, special_ids=np.array([-1]),
                            vocab_size=1, prob=prob)
    return labels != -100


@lru_cache(maxsize=4)
def _held_out(spec: HMMSpec, length: int) -> tuple[np.ndarray, np.ndarray]:
    """The held-out rows' words and masks: a function of the language alone, whatever the run's seed."""
    rng = np.random.default_rng([spec.seed, _SPLITS["eval"], 0x45])
    words = HMMLanguage.generate(spec).sample(EVAL_ROWS, length, rng)
    return words, _select(EVAL_ROWS, length, MASK_PROB, rng)


@lru_cache(maxsize=4)
def _row_losses(spec: HMMSpec, length: int) -> list[np.ndarray]:
    """Per held-out row, the Bayes-optimal loss of each masked position (cached per language)."""
    lang = HMMLanguage.generate(spec)
    words, masked = _held_out(spec, length)
    out: list[np.ndarray] = []
    for lo in range(0, EVAL_ROWS, 512):  # forward-backward in chunks bounds the memory
        flat = lang.posterior_loss(words[lo:lo + 512], masked[lo:lo + 512])
        counts = masked[lo:lo + 512].sum(axis=1)
        out.extend(np.split(flat, np.cumsum(counts)[:-1]))
    return out
