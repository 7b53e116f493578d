"""Sentence-pair examples as numpy memmaps, built once per (corpus, tokenizer, seq_len, seed).

Two cached stages, both in the corpus's cache directory:

1. ``tokens-<tokenizer>/``: every sentence tokenised once (``tokens.bin``, flat ids) with
   sentence and document offsets. Independent of sequence length and seed.
2. ``examples-<tokenizer>-L<seq_len>-s<seed>-e<eval>/``: BERT's pair segmentation
   (``create_pretraining_data``), per split, as fixed-width rows ``[CLS] A [SEP] B [SEP] [PAD]...``
   in ``<split>.ids`` (``uint16`` when the vocabulary fits, else ``int32``), with the row length,
   the start of segment B, and the next-sentence label (1 = B is random).

Segmentation, per document: a target length is ``seq_len - 3`` (or, with probability 0.1, a random
shorter one, so the model also sees short inputs); sentences are gathered until the target is
reached; a random prefix of them is A; with probability 0.5 (always, for a one-sentence chunk) B is
taken from a random other document and the unused sentences go back, else B is the rest of the
chunk; the longer of A and B is truncated from a random end until the pair fits.

Evaluation: about ``eval_fraction`` of the *documents* are held out, so evaluation text never
appears in training examples; random-next segments are drawn within the split when it has two
documents or more. The held-out set does not depend on the seed (only the training examples do),
so runs with different seeds are evaluated on the same examples. Masking is not stored: it is
applied per batch (:mod:`gradzip.data.pretrain`), so every epoch sees new masks (dynamic masking,
as RoBERTa).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gradzip.data.corpus import Corpus, locked, staging
from gradzip.data.progress import progress_bar
from gradzip.data.tokenizer import WordPieceTokenizer
from gradzip.errors import GradzipError

EXAMPLES_FORMAT = 2
SHORT_SEQ_PROB = 0.1
RANDOM_NEXT_PROB = 0.5
EVAL_SEED = 0  # the held-out set is the same for every training seed
_ENCODE_CHUNK = 16384  # sentences per encode_batch call
_WRITE_CHUNK = 4096  # example rows buffered before a write


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


@dataclass(frozen=True)
class ExampleSet:
    """One split: ``ids`` is ``(n, seq_len)`` (a read-only memmap), ``length`` the number of real
    tokens per row, ``b_start`` the first position of segment B (token type 1 from there to
    ``length``), ``nsp`` 1 where B is a random segment."""

    ids: np.ndarray
    length: np.ndarray
    b_start: np.ndarray
    nsp: np.ndarray

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @classmethod
    def open(cls, directory: Path, split: str, n: int, seq_len: int, dtype: np.dtype) -> ExampleSet:
        path = directory / f"{split}.ids"
        ids = np.memmap(path, dtype=dtype, mode="r", shape=(n, seq_len)) if n else np.zeros((0, seq_len), dtype)
        return cls(ids, np.load(directory / f"{split}.length.npy"), np.load(directory / f"{split}.b_start.npy"),
                   np.load(directory / f"{split}.nsp.npy"))


# ----------------------------------------------------------------------------------------------
# Stage 1: tokenise every sentence once


@dataclass(frozen=True)
class TokenizedCorpus:
    tokens: np.ndarray  # flat ids of all sentences
    sent_offsets: np.ndarray  # (num_sentences + 1,) into tokens
    doc_offsets: np.ndarray  # (num_docs + 1,) into sentences

    @property
    def num_docs(self) -> int:
        return len(self.doc_offsets) - 1


def tokenize_corpus(corpus: Corpus, tok: WordPieceTokenizer, progress: bool = True) -> TokenizedCorpus:
    """Tokenise the corpus once (cached); sentences that tokenise to nothing are dropped."""
    final = corpus.directory / f"tokens-{tok.fingerprint[:12]}"
    dtype = token_dtype(tok.vocab_size)
    with locked(corpus.directory / f"{final.name}.lock"):
        if not (final / "meta.json").exists():
            with staging(final) as tmp:
                _tokenize_into(tmp, corpus, tok, dtype, progress)
        meta = json.loads((final / "meta.json").read_text())
    tokens = np.memmap(final / "tokens.bin", dtype=dtype, mode="r", shape=(meta["num_tokens"],))
    return TokenizedCorpus(tokens, np.load(final / "sent_offsets.npy"), np.load(final / "doc_offsets.npy"))


def _tokenize_into(directory: Path, corpus: Corpus, tok: WordPieceTokenizer, dtype: np.dtype, progress: bool) -> None:
    t0 = time.perf_counter()
    sent_lengths: list[np.ndarray] = []
    doc_sizes: list[int] = []  # non-empty sentences per document
    pending: list[str] = []
    pending_docs: list[int] = []  # sentences per pending document
    n_tokens = 0
    bar = progress_bar(total=corpus.num_sentences, desc="tokenizing corpus", unit="sent", disable=not progress,
                       mininterval=0.5)
    with open(directory / "tokens.bin", "wb") as out:

        def flush() -> None:
            nonlocal n_tokens
            if not pending:
                return
            encoded = tok.encode_batch(pending)
            lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
            flat = np.fromiter((i for e in encoded for i in e), dtype=dtype, count=int(lengths.sum()))
            flat.tofile(out)
            n_tokens += flat.size
            start = 0
            for n in pending_docs:
                kept = lengths[start:start + n]
                kept = kept[kept > 0]
                if kept.size:
                    sent_lengths.append(kept)
                    doc_sizes.append(kept.size)
                start += n
            bar.update(len(pending))
            pending.clear()
            pending_docs.clear()

        for doc in corpus.documents():
            pending.extend(doc)
            pending_docs.append(len(doc))
            if len(pending) >= _ENCODE_CHUNK:
                flush()
        flush()
    bar.close()
    lengths_all = np.concatenate(sent_lengths) if sent_lengths else np.zeros(0, np.int64)
    np.save(directory / "sent_offsets.npy", np.concatenate([[0], np.cumsum(lengths_all)]).astype(np.int64))
    np.save(directory / "doc_offsets.npy", np.concatenate([[0], np.cumsum(doc_sizes)]).astype(np.int64))
    meta = dict(format=EXAMPLES_FORMAT, tokenizer=tok.fingerprint, corpus=corpus.fingerprint, num_tokens=n_tokens,
                num_sentences=int(lengths_all.size), num_docs=len(doc_sizes), dtype=dtype.name,
                build_s=round(time.perf_counter() - t0, 2))
    (directory / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


# ----------------------------------------------------------------------------------------------
# Stage 2: pair segmentation


def _truncated_lengths(la: int, lb: int, max_total: int) -> tuple[int, int]:
    """Lengths after BERT's truncate_seq_pair: drop one token at a time from the longer segment
    (from B on ties) until the pair fits."""
    excess = la + lb - max_total
    if excess <= 0:
        return la, lb
    take = min(excess, abs(la - lb))
    if la > lb:
        la -= take
    else:
        lb -= take
    excess -= take
    return la - excess // 2, lb - (excess - excess // 2)


class _Writer:
    """Buffers fixed-width rows and appends them to ``<split>.ids``."""

    def __init__(self, path: Path, seq_len: int, dtype: np.dtype, pad_id: int) -> None:
        self.fh = open(path, "wb")
        self.buf = np.full((_WRITE_CHUNK, seq_len), pad_id, dtype=dtype)
        self.pad_id = pad_id
        self.fill = 0
        self.length: list[int] = []
        self.b_start: list[int] = []
        self.nsp: list[int] = []

    def add(self, row: np.ndarray, b_start: int, is_random: bool) -> None:
        self.buf[self.fill, :row.size] = row
        self.fill += 1
        self.length.append(row.size)
        self.b_start.append(b_start)
        self.nsp.append(int(is_random))
        if self.fill == len(self.buf):
            self.flush()

    def flush(self) -> None:
        self.buf[:self.fill].tofile(self.fh)
        self.buf[:self.fill] = self.pad_id
        self.fill = 0

    def close(self, directory: Path, split: str) -> int:
        self.flush()
        self.fh.close()
        small = np.int16 if self.buf.shape[1] < 1 << 15 else np.int32
        np.save(directory / f"{split}.length.npy", np.asarray(self.length, dtype=small))
        np.save(directory / f"{split}.b_start.npy", np.asarray(self.b_start, dtype=small))
        np.save(directory / f"{split}.nsp.npy", np.asarray(self.nsp, dtype=np.uint8))
        return len(self.length)


def segment(tc: TokenizedCorpus, tok: WordPieceTokenizer, seq_len: int, seed: int, eval_fraction: float,
            directory: Path, progress: bool = True) -> dict:
    """Write the train and eval example sets into ``directory``; returns their sizes."""
    n_docs = tc.num_docs
    if n_docs < 2:
        raise GradzipError(f"the corpus has {n_docs} document(s); next-sentence prediction needs at least 2 "
                           f"(separate documents with a blank line)")
    # The held-out documents, their segmentation and (in pretrain.py) their masks do not depend on
    # the seed: eval losses of runs with different seeds are measured on the same examples.
    split_rng = np.random.default_rng([EVAL_SEED, 1])
    n_eval = min(n_docs - 1, max(1, round(eval_fraction * n_docs))) if eval_fraction > 0 else 0
    is_eval = np.zeros(n_docs, dtype=bool)
    is_eval[split_rng.choice(n_docs, size=n_eval, replace=False)] = True
    pools = {s: np.flatnonzero(is_eval == (s == "eval")) for s in ("train", "eval")}
    all_docs = np.arange(n_docs)

    dtype = token_dtype(tok.vocab_size)
    writers = {s: _Writer(directory / f"{s}.ids", seq_len, dtype, tok.pad_id) for s in ("train", "eval")}
    rngs = {"train": np.random.default_rng([seed, 2]), "eval": np.random.default_rng([EVAL_SEED, 3])}
    max_tokens = seq_len - 3
    so, do, tokens = tc.sent_offsets, tc.doc_offsets, tc.tokens
    cls_, sep = np.array([tok.cls_id], dtype), np.array([tok.sep_id], dtype)

    def span(first: int, last: int) -> np.ndarray:  # tokens of sentences [first, last)
        return tokens[so[first]:so[last]]

    for d in progress_bar(range(n_docs), desc=f"building examples (seq_len {seq_len})", unit="doc",
                          disable=not progress, mininterval=0.5):
        split = "eval" if is_eval[d] else "train"
        pool = pools[split] if len(pools[split]) >= 2 else all_docs
        rng = rngs[split]
        first, end = int(do[d]), int(do[d + 1])
        target = max_tokens if rng.random() >= SHORT_SEQ_PROB else int(rng.integers(2, max_tokens + 1))
        chunk_start, length, i = first, 0, first
        while i < end:
            length += int(so[i + 1] - so[i])
            if i == end - 1 or length >= target:
                n_chunk = i + 1 - chunk_start
                a_end = chunk_start + (int(rng.integers(1, n_chunk)) if n_chunk >= 2 else 1)
                a = span(chunk_start, a_end)
                if n_chunk == 1 or rng.random() < RANDOM_NEXT_PROB:
                    is_random = True
                    other = d
                    while other == d:
                        other = int(pool[rng.integers(len(pool))])
                    o_first, o_end = int(do[other]), int(do[other + 1])
                    j = int(rng.integers(o_first, o_end))
                    want = max(1, target - a.size)
                    k = int(np.searchsorted(so, so[j] + want, side="left"))  # first k with so[k] >= so[j] + want
                    b = span(j, min(max(k, j + 1), o_end))
                    i = a_end - 1  # the unused sentences of the chunk start the next one
                else:
                    is_random = False
                    b = span(a_end, i + 1)
                la, lb = _truncated_lengths(a.size, b.size, max_tokens)
                a = _cut(a, la, rng)
                b = _cut(b, lb, rng)
                writers[split].add(np.concatenate([cls_, a, sep, b, sep]), la + 2, is_random)
                chunk_start, length = i + 1, 0
            i += 1
    return {s: w.close(directory, s) for s, w in writers.items()}


def _cut(seg: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Keep ``n`` tokens, dropping each excess token from the front or the back at random."""
    drop = seg.size - n
    if drop <= 0:
        return seg
    front = int(rng.binomial(drop, 0.5))
    return seg[front:front + n]


def build_examples(corpus: Corpus, tok: WordPieceTokenizer, seq_len: int = 128, seed: int = 0,
                   eval_fraction: float = 0.01, progress: bool = True) -> tuple[ExampleSet, ExampleSet, Path]:
    """The (train, eval) example sets, built once and cached; also returns their directory."""
    if not 8 <= seq_len <= 8192:
        raise GradzipError(f"seq_len must be in [8, 8192] (BERT uses 128 and 512), got {seq_len}")
    if not 0.0 <= eval_fraction < 0.5:
        raise GradzipError(f"eval_fraction must be in [0, 0.5), got {eval_fraction}")
    name = f"examples-{tok.fingerprint[:12]}-L{seq_len}-s{seed}-e{eval_fraction:g}-v{EXAMPLES_FORMAT}"
    final = corpus.directory / name
    tc = tokenize_corpus(corpus, tok, progress)
    with locked(corpus.directory / f"{name}.lock"):
        if not (final / "meta.json").exists():
            with staging(final) as tmp:
                t0 = time.perf_counter()
                sizes = segment(tc, tok, seq_len, seed, eval_fraction, tmp, progress)
                meta = dict(format=EXAMPLES_FORMAT, corpus=corpus.fingerprint, tokenizer=tok.fingerprint,
                            seq_len=seq_len, seed=seed, eval_fraction=eval_fraction, num_train=sizes["train"],
                            num_eval=sizes["eval"], dtype=token_dtype(tok.vocab_size).name,
                            build_s=round(time.perf_counter() - t0, 2))
                (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        meta = json.loads((final / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    return (ExampleSet.open(final, "train", meta["num_train"], seq_len, dtype),
            ExampleSet.open(final, "eval", meta["num_eval"], seq_len, dtype), final)
