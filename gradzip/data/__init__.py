"""Pretraining data: corpus sources (:mod:`.corpus`, default corpus in :mod:`.harvest`), WordPiece
tokenizer (:mod:`.tokenizer`), memmapped sentence-pair examples (:mod:`.examples`) and masked,
deterministically sharded batches (:mod:`.pretrain`).

    data = PretrainData.build(corpus=None, seq_len=128, vocab_size=8192)
    batch = data.batch("train", step=k, worker=w, num_workers=N, batch_size=B, seed=0)

Names are imported on first use, so that ``gradzip.data.corpus`` and ``.harvest`` (also run in
the harvest's worker processes) do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "Corpus": "corpus", "cache_root": "corpus", "load_corpus": "corpus", "split_sentences": "corpus",
    "PretrainData": "pretrain", "mask_tokens": "pretrain",
    "DEFAULT_VOCAB_SIZE": "tokenizer", "SPECIAL_TOKENS": "tokenizer", "WordPieceTokenizer": "tokenizer",
    "get_tokenizer": "tokenizer",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from gradzip.data.corpus import Corpus, cache_root, load_corpus, split_sentences  # noqa: F401
    from gradzip.data.pretrain import PretrainData, mask_tokens  # noqa: F401
    from gradzip.data.tokenizer import (  # noqa: F401
        DEFAULT_VOCAB_SIZE,
        SPECIAL_TOKENS,
        WordPieceTokenizer,
        get_tokenizer,
    )


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"gradzip.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'gradzip.data' has no attribute {name!r}")
