"""WordPiece tokenizer (BERT's), built with Hugging Face ``tokenizers``.

Pipeline, as ``BertWordPieceTokenizer``: BERT normaliser (clean control characters, split CJK
characters, strip accents, lowercase), BERT pre-tokeniser (whitespace and punctuation), WordPiece
with ``##`` continuation prefix, and a post-processor that adds ``[CLS] A [SEP] B [SEP]``. A
trained vocabulary starts with ``[PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4``.

:func:`get_tokenizer` trains one on a corpus (once; cached next to the corpus, keyed by the corpus
fingerprint and vocabulary size; the vocabulary is learnt deterministically by
:mod:`gradzip.data.wordpiece`), or loads ``vocab.txt`` (a BERT
vocabulary; cased if it has capitalised tokens) or ``tokenizer.json``.

Vocabulary size: the model's, e.g. 8192 for bert-tiny/mini (see ``gradzip.models.MODEL_SIZES``).
A small corpus may yield fewer pieces than asked for; ``vocab_size`` is what was built, and the
model must use it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from gradzip.data.corpus import Corpus, locked, progress_enabled
from gradzip.data.wordpiece import count_words, learn_vocab
from gradzip.errors import GradzipError

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
DEFAULT_VOCAB_SIZE = 8192
TOKENIZER_FORMAT = 2
_MIN_FREQUENCY = 2  # a piece must occur twice: singletons are noise (typos, hashes, identifiers)
_LIMIT_ALPHABET = 1000


def _bert_pipeline(tok, lowercase: bool) -> None:
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=lowercase,
                                                lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")


class WordPieceTokenizer:
    """A ``tokenizers.Tokenizer`` plus the ids of BERT's special tokens.

    Attributes: ``tokenizer`` (the HF object), ``vocab_size``, ``pad_id``, ``unk_id``, ``cls_id``,
    ``sep_id``, ``mask_id``, ``special_ids`` (sorted array), ``fingerprint`` (sha256 of its JSON),
    ``source`` (where it came from).
    """

    def __init__(self, tokenizer, source: str) -> None:
        self.tokenizer = tokenizer
        self.source = source
        ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise GradzipError(f"tokenizer {source} lacks the special token(s) {', '.join(missing)}; BERT needs "
                               f"{', '.join(SPECIAL_TOKENS)}")
        # Registered as special: matched whole in input text, skipped by decode (ids unchanged).
        tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (int(ids[t]) for t in SPECIAL_TOKENS)
        self.special_ids = np.array(sorted(set(ids.values())), dtype=np.int64)
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", self.cls_id), ("[SEP]", self.sep_id)])
        self.fingerprint = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()

    def continuation_ids(self) -> np.ndarray:
        """A boolean array over the ids: True for WordPiece continuation pieces (``##ing``), which
        belong to the word of the piece before them. Whole-word masking reads words from it; a
        tokenizer that is not WordPiece has no such pieces, a :class:`GradzipError`."""
        model = self.tokenizer.model
        prefix = getattr(model, "continuing_subword_prefix", None)
        if type(model).__name__ != "WordPiece" or not prefix:
            raise GradzipError(f"tokenizer {self.source} is a {type(model).__name__} model without WordPiece "
                               "continuation pieces (##), so its words are unknown; whole-word masking needs a "
                               "WordPiece tokenizer")
        out = np.zeros(self.vocab_size, dtype=bool)
        for token, i in self.tokenizer.get_vocab(with_added_tokens=True).items():
            if token.startswith(prefix) and len(token) > len(prefix) and i < self.vocab_size:
                out[i] = True
        out[self.special_ids] = False
        return out

    def encode(self, text: str, pair: str | None = None, special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (and ``pair``), with ``[CLS]``/``[SEP]`` unless ``special_tokens=False``."""
        return list(self.tokenizer.encode(text, pair, add_special_tokens=special_tokens).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of many texts without special tokens, in parallel (Rust threads)."""
        fast = getattr(self.tokenizer, "encode_batch_fast", None)  # tokenizers >= 0.21: skips offsets
        encodings = (fast or self.tokenizer.encode_batch)(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, path: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` (loadable by :meth:`from_file` and by ``transformers``)."""
        tmp = Path(f"{path}.tmp{os.getpid()}")
        self.tokenizer.save(str(tmp))
        os.replace(tmp, path)

    @classmethod
    def train(cls, files: Sequence[str | os.PathLike], vocab_size: int, progress: bool = True) -> WordPieceTokenizer:
        """Learn an uncased WordPiece vocabulary of at most ``vocab_size`` pieces from text files,
        deterministically (:mod:`gradzip.data.wordpiece`)."""
        vocab = learn_vocab(count_words(files), vocab_size, SPECIAL_TOKENS, min_frequency=_MIN_FREQUENCY,
                            limit_alphabet=_LIMIT_ALPHABET, progress=progress)
        tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]",
                                         continuing_subword_prefix="##"))
        _bert_pipeline(tok, lowercase=True)
        return cls(tok, f"trained on {', '.join(str(f) for f in files)}")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> WordPieceTokenizer:
        """Load a ``tokenizer.json`` or a BERT ``vocab.txt`` (one token per line)."""
        p = Path(path).expanduser()
        if not p.is_file():
            raise GradzipError(f"tokenizer file {p} does not exist; give a vocab.txt or tokenizer.json")
        if p.suffix == ".json":
            try:
                tok = Tokenizer.from_file(str(p))
            except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
                raise GradzipError(f"cannot load tokenizer {p}: {str(e)[:200]}") from None
            return cls(tok, str(p))
        try:
            vocab = [line.rstrip("\n") for line in p.read_text(encoding="utf-8").splitlines()]
        except UnicodeDecodeError:
            raise GradzipError(f"{p} is not a UTF-8 vocab.txt") from None
        if len(vocab) < len(SPECIAL_TOKENS) + 1:
            raise GradzipError(f"{p} has {len(vocab)} tokens; a vocab.txt lists one token per line")
        # BERT's cased vocabularies contain capitalised words; uncased ones none.
        regular = [t for t in vocab if not t.startswith("[")]
        cased = sum(any(c.isupper() for c in t) for t in regular) > 0.01 * max(1, len(regular))
        tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]",
                                         continuing_subword_prefix="##"))
        _bert_pipeline(tok, lowercase=not cased)
        return cls(tok, str(p))


def get_tokenizer(corpus: Corpus, vocab_size: int | None = None, path: str | os.PathLike | None = None,
                  progress: bool = True) -> WordPieceTokenizer:
    """Load ``path`` if given, else the WordPiece tokenizer trained on ``corpus`` (cached)."""
    if path is not None:
        return WordPieceTokenizer.from_file(path)
    vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else int(vocab_size)
    if not 64 <= vocab_size <= 1_000_000:
        raise GradzipError(f"vocab_size must be in [64, 1000000], got {vocab_size}")
    settings = f"{TOKENIZER_FORMAT}|{corpus.fingerprint}|{vocab_size}|{_MIN_FREQUENCY}|{_LIMIT_ALPHABET}"
    final = corpus.directory / f"tokenizer-wp{vocab_size}-{hashlib.sha256(settings.encode()).hexdigest()[:10]}.json"
    with locked(final.with_suffix(".lock")):
        if final.exists():
            return WordPieceTokenizer(_load(final), str(final))
        tok = WordPieceTokenizer.train([corpus.text_path], vocab_size, progress=progress_enabled(progress))
        tok.save(final)
        tok.source = str(final)
        return tok


def _load(path: Path):
    return Tokenizer.from_file(str(path))
