"""A deterministic WordPiece vocabulary trainer.

Why not ``tokenizers.trainers.WordPieceTrainer``: it numbers the ``##`` continuation pieces in
hash-map order, which is random per process, and breaks ties between equally frequent merges by
those numbers, so two trainings on the same corpus give different vocabularies (measured with
tokenizers 0.23). Runs must be reproducible across machines from the corpus alone, so the
vocabulary is learnt here and only *applied* with ``tokenizers`` (``models.WordPiece``).

Algorithm (the BPE-style procedure of ``WordPieceTrainer``, with every order fixed):

1. Words: the text is lowercased, accents and control characters are removed, and it is split
   at whitespace and punctuation, as BERT's normaliser and pre-tokeniser do. Words are counted.
2. Alphabet: the ``limit_alphabet`` most frequent characters (ties by code point). Each word is a
   sequence of symbols: its first character, then ``##``-prefixed continuation characters.
3. Merges: repeatedly merge the most frequent adjacent pair of symbols (weighted by word count;
   ties: the pair of earliest-created symbols) into a new symbol, until the vocabulary has
   ``vocab_size`` entries or no pair occurs ``min_frequency`` times.

The vocabulary is: special tokens, the alphabet, its ``##`` forms, then merged symbols in order.
Cost: one pass over the text plus ~10 s of Python for 8k pieces on the 14 MB default corpus.
"""

from __future__ import annotations

import heapq
import os
import re
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Sequence

from gradzip.data.progress import progress_bar

_ASCII_PUNCT = r"!-/:-@\[-`{-~"
_WORD = re.compile(rf"[^\s{_ASCII_PUNCT}]+|[{_ASCII_PUNCT}]")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_MAX_WORD = 100  # WordPiece maps longer words to [UNK]; do not learn from them


def _normalise(text: str) -> str:
    text = _CONTROL.sub(" ", text.lower())
    if text.isascii():
        return text
    out = []
    for ch in unicodedata.normalize("NFD", text):
        cat = unicodedata.category(ch)
        if cat == "Mn" or cat in ("Cc", "Cf"):  # accents; control and format characters
            continue
        out.append(f" {ch} " if cat.startswith("P") else ch)  # non-ASCII punctuation is its own word
    return "".join(out)


def count_words(files: Sequence[str | os.PathLike]) -> Counter:
    """Word counts of UTF-8 text files (see step 1)."""
    counts: Counter = Counter()
    for f in files:
        with open(f, encoding="utf-8") as fh:
            while chunk := fh.read(1 << 20):
                counts.update(_WORD.findall(_normalise(chunk + fh.readline())))
    return counts


def learn_vocab(counts: Counter, vocab_size: int, special_tokens: Sequence[str], min_frequency: int = 2,
                limit_alphabet: int = 1000, prefix: str = "##", progress: bool = False) -> list[str]:
    """The vocabulary (list index = id) learnt from word counts (see steps 2 and 3)."""
    words = sorted((w, n) for w, n in counts.items() if len(w) <= _MAX_WORD)
    alphabet = _alphabet(words, vocab_size, len(special_tokens), limit_alphabet)
    vocab: list[str] = []
    index: dict[str, int] = {}

    def add(token: str) -> int:
        if token not in index:
            index[token] = len(vocab)
            vocab.append(token)
        return index[token]

    for t in [*special_tokens, *alphabet, *(prefix + ch for ch in alphabet)]:
        add(t)
    known = set(alphabet)
    seqs: list[list[int]] = []
    freqs: list[int] = []
    for w, n in words:
        kept = [ch for ch in w if ch in known]
        if kept:
            seqs.append([index[kept[0]], *(index[prefix + ch] for ch in kept[1:])])
            freqs.append(n)

    pair_count: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)  # pair -> words that (may) contain it
    for wi, sym in enumerate(seqs):
        for pair in zip(sym, sym[1:]):
            pair_count[pair] += freqs[wi]
            where[pair].add(wi)
    # Max-heap by (count, then smallest pair) with lazy deletion: stale entries are re-pushed.
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    cut = len(prefix)
    bar = progress_bar(total=max(0, vocab_size - len(vocab)), desc="learning WordPiece vocabulary", unit="piece",
                       disable=not progress, mininterval=0.5)
    while len(vocab) < vocab_size and heap:
        neg, pair = heapq.heappop(heap)
        count = pair_count.get(pair, 0)
        if count != -neg:
            if count > 0:
                heapq.heappush(heap, (-count, pair))
            continue
        if count < min_frequency:
            break
        a, b = pair
        before = len(vocab)
        new = add(vocab[a] + vocab[b][cut:])  # the right symbol is always a ##continuation
        bar.update(len(vocab) - before)
        touched = _apply_merge(pair, new, seqs, freqs, pair_count, where)
        pair_count.pop(pair, None)
        for p in touched:
            c = pair_count.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pair_count.pop(p, None)
    bar.close()
    return vocab


def _alphabet(words: list[tuple[str, int]], vocab_size: int, n_special: int, limit_alphabet: int) -> list[str]:
    """The characters of the vocabulary, sorted: the ``limit_alphabet`` most frequent ones (ties by
    character), fewer if the vocabulary has no room for them and their ``##`` forms."""
    chars: Counter = Counter()
    for w, n in words:
        for ch in w:
            chars[ch] += n
    # The alphabet and its ## forms must leave room in the vocabulary: rarer characters become [UNK].
    limit_alphabet = max(1, min(limit_alphabet, (vocab_size - n_special) // 2))
    return sorted(ch for ch, _ in sorted(chars.items(), key=lambda kv: (-kv[1], kv[0]))[:limit_alphabet])


def _apply_merge(pair: tuple[int, int], new: int, seqs: list[list[int]], freqs: list[int],
                 pair_count: dict[tuple[int, int], int],
                 where: dict[tuple[int, int], set[int]]) -> dict[tuple[int, int], None]:
    """Replace ``pair`` by the symbol ``new`` in every word that contains it, keeping ``pair_count``
    and ``where`` up to date; returns the pairs whose counts changed, in the order first changed."""
    a, b = pair
    touched: dict[tuple[int, int], None] = {}
    for wi in sorted(where.pop(pair, ())):
        sym, n = seqs[wi], freqs[wi]
        for p in zip(sym, sym[1:]):
            pair_count[p] -= n
            touched[p] = None
        out, i = [], 0
        while i < len(sym):
            if i + 1 < len(sym) and sym[i] == a and sym[i + 1] == b:
                out.append(new)
                i += 2
            else:
                out.append(sym[i])
                i += 1
        seqs[wi] = out
        for p in zip(out, out[1:]):
            pair_count[p] += n
            where[p].add(wi)
            touched[p] = None
    return touched
