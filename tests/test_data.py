"""Data pipeline: corpus sources and their errors, tokenizer, pair examples (NSP), masking
statistics, deterministic sharding, caching, and the suite's own cache (conftest). Small corpora
are written to tmp dirs; one test builds the default corpus, in a temporary cache of its own."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from gradzip.data import PretrainData, cache_root, load_corpus, mask_tokens, split_sentences
from gradzip.data.examples import tokenize_corpus
from gradzip.data.tokenizer import SPECIAL_TOKENS, WordPieceTokenizer, get_tokenizer
from gradzip.errors import GradzipError

WORDS = ("the a of to and in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when if so no will more can out other into "
         "time only new some could these two may first then do any like my now over such our man me even most made "
         "after also did many before must through back years where much your way well down should because each just "
         "those people how too little state good very make world still own see men work long get here between both "
         "life being under never day same another know while last might us great old year off come since against "
         "go came right used take three tensor gradient network model layer compress worker signal").split()


def write_corpus(path, n_docs=240, seed=0):
    """Documents of 3-9 sentences of 5-14 words, blank-line separated, one sentence per line."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        sents = []
        for _ in range(rng.integers(3, 10)):
            words = [WORDS[i] for i in rng.integers(0, len(WORDS), rng.integers(5, 15))]
            sents.append(" ".join(words).capitalize() + ".")
        docs.append("\n".join(sents))
    path.write_text("\n\n".join(docs) + "\n")
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    (root / "corpus").mkdir()
    write_corpus(root / "corpus" / "a.txt")
    write_corpus(root / "corpus" / "b.txt", seed=1)
    data = PretrainData.build(corpus=root / "corpus", seq_len=64, vocab_size=300, cache_dir=root / "cache",
                              progress=False)
    return data, root


# ----------------------------------------------------------------------------------------------
# Corpus


def test_split_sentences():
    assert split_sentences("It works. See e.g. the docs!  Then 3 more? \"Quoted.\" Done") == [
        "It works.", "See e.g. the docs!", "Then 3 more?", '"Quoted."', "Done"]
    assert split_sentences("Version 2.5 is out. J. Smith wrote it.") == ["Version 2.5 is out.", "J. Smith wrote it."]
    assert split_sentences("   ") == []


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("GRADZIP_CACHE", raising=False)
    assert cache_root() == tmp_path / "xdg" / "gradzip"
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path / "gz"))
    assert cache_root() == tmp_path / "gz"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_conftest_computes_the_cache_root_as_the_library_does(tmp_path, monkeypatch):
    from conftest import user_cache_path

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for gz, xdg in ((None, None), (None, tmp_path / "xdg"), (tmp_path / "gz", tmp_path / "xdg")):
        for var, value in (("GRADZIP_CACHE", gz), ("XDG_CACHE_HOME", xdg)):
            if value is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, str(value))
        expected = user_cache_path()
        assert not expected.exists()  # computed, not created
        assert cache_root() == expected


def test_the_suite_uses_its_own_cache_and_children_inherit_it(session_cache, user_cache):
    assert cache_root() == session_cache and os.environ["GRADZIP_CACHE"] == str(session_cache)
    assert not session_cache.is_relative_to(user_cache) and not user_cache.is_relative_to(session_cache)
    child = subprocess.run([sys.executable, "-c", "from gradzip.data import cache_root; print(cache_root())"],
                           capture_output=True, text=True, timeout=60, check=True)
    assert child.stdout.strip() == str(session_cache)


def test_text_and_jsonl_sources(tmp_path):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "one.txt").write_text("First doc. It has two sentences.\n\nSecond doc\nwraps over lines. Yes.\n")
    (d / "sub" / "two.jsonl").write_text(json.dumps({"text": "Json doc one. Fine."}) + "\n\n" +
                                         json.dumps({"text": "Json doc two.", "id": 3}) + "\n")
    (d / "wiki_00").write_text("<doc id=1>\nTitle line\nBody text here.\n</doc>\n<doc id=2>\nOther.\n</doc>\n")
    (d / "image.png").write_bytes(b"\x89PNG\0\0")  # not a text suffix: ignored
    (d / ".hidden.txt").write_text("Hidden. Ignored.")
    c = load_corpus(d, cache_dir=tmp_path / "cache", progress=False)
    docs = list(c.documents())
    assert docs == [["First doc.", "It has two sentences."], ["Second doc wraps over lines.", "Yes."],
                    ["Json doc one.", "Fine."], ["Json doc two."], ["Title line Body text here."], ["Other."]]
    assert c.fingerprint == hashlib.sha256(c.text_path.read_bytes()).hexdigest()
    assert load_corpus(d, cache_dir=tmp_path / "cache", progress=False).directory == c.directory  # cached
    (d / "one.txt").write_text("Edited. Text.\n\nMore. Text.\n")  # an edit invalidates the cache
    assert load_corpus(d, cache_dir=tmp_path / "cache", progress=False).fingerprint != c.fingerprint


def _bad_input(kind, p):
    """Write a bad corpus of the given kind under ``p``; return the path to give."""
    files = {"empty": b"", "blank": b"\n \n\n", "binary": b"abc\0\x01\x02" * 10,
             "latin1": b"Fine line.\nCaf\xe9 au lait.\n", "no_text": b'{"text": "ok"}\n{"body": "no text"}\n',
             "bad_json": b'{"text": "ok"}\n{"text": \n'}
    if kind == "missing":
        return p / "nope.txt"
    if kind == "no_text_files":
        (p / "d").mkdir()
        (p / "d" / "a.bin").write_bytes(b"\1\2")
        return p / "d"
    path = p / (f"{kind}.jsonl" if kind in ("no_text", "bad_json") else f"{kind}.txt")
    path.write_bytes(files[kind])
    return path


@pytest.mark.parametrize("kind, message", [
    ("missing", "does not exist"),
    ("empty", "is empty"),
    ("blank", "is empty"),
    ("binary", "binary file"),
    ("latin1", r"not UTF-8 text \(undecodable byte at line 2"),
    ("no_text", r"no_text.jsonl:2: no string 'text' field"),
    ("bad_json", r"bad_json.jsonl:2: not valid JSON"),
    ("no_text_files", "contains no text files"),
])
def test_bad_corpus_inputs_give_one_line_errors(tmp_path, kind, message):
    path = _bad_input(kind, tmp_path)
    with pytest.raises(GradzipError, match=message) as e:
        PretrainData.build(corpus=path, cache_dir=tmp_path / "cache", progress=False)
    assert "\n" not in str(e.value) and path.name in str(e.value)
    assert not any((tmp_path / "cache" / "corpora").glob("*/meta.json"))  # nothing half-built was cached


def test_single_document_is_refused_for_nsp(tmp_path):
    (tmp_path / "one.txt").write_text("Only one document. It has sentences. But no second one.\n")
    with pytest.raises(GradzipError, match="at least 2"):
        PretrainData.build(corpus=tmp_path / "one.txt", cache_dir=tmp_path / "cache", progress=False)


def test_hf_datasets_source(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(GradzipError, match="needs the `datasets` package"):
        load_corpus("hf:wikitext:wikitext-2-raw-v1", cache_dir=tmp_path, progress=False)
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        if name == "offline":
            raise ConnectionError("Couldn't reach the Hub")
        return [{"text": ""}, {"text": " = Alpha = \n"}, {"text": " First para. Of alpha. \n"},
                {"text": " = = Section = = \n"}, {"text": " More alpha text. \n"}, {"text": " = Beta = \n"},
                {"text": " Beta text here. \n"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset, __version__="9"))
    c = load_corpus("hf:wikitext:wikitext-2-raw-v1", cache_dir=tmp_path, progress=False)
    assert calls == [("wikitext", "wikitext-2-raw-v1", "train")]
    assert list(c.documents()) == [["First para.", "Of alpha.", "More alpha text."], ["Beta text here."]]
    with pytest.raises(GradzipError, match="cannot load dataset 'offline'.*reach the Hub"):
        load_corpus("hf:offline", cache_dir=tmp_path, progress=False)


# ----------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_special_ids_and_file_round_trips(small, tmp_path):
    data, _ = small
    tok = data.tokenizer
    assert [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id] == [0, 1, 2, 3, 4]
    assert 200 < tok.vocab_size <= 300
    text = "The gradient of the network was compressed."
    ids = tok.encode(text)
    assert ids[0] == tok.cls_id and ids[-1] == tok.sep_id
    assert tok.decode(ids) == text.lower()
    # tokenizer.json and a BERT vocab.txt reproduce the encoding
    tok.save(tmp_path / "tokenizer.json")
    vocab = sorted(tok.tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    (tmp_path / "vocab.txt").write_text("".join(t + "\n" for t, _ in vocab))
    for f in ("tokenizer.json", "vocab.txt"):
        other = get_tokenizer(data.corpus, path=tmp_path / f)
        assert other.encode(text) == ids and other.vocab_size == tok.vocab_size
    (tmp_path / "bad.txt").write_text("".join(t + "\n" for t, _ in vocab if t != "[MASK]"))
    with pytest.raises(GradzipError, match=r"lacks the special token\(s\) \[MASK\]"):
        WordPieceTokenizer.from_file(tmp_path / "bad.txt")


def test_tokenizer_training_is_deterministic_and_sized(small):
    data, _ = small
    again = WordPieceTokenizer.train([data.corpus.text_path], 300, progress=False)
    assert again.fingerprint == data.tokenizer.fingerprint
    small_vocab = WordPieceTokenizer.train([data.corpus.text_path], 64, progress=False)
    assert small_vocab.vocab_size == 64  # the alphabet shrinks to fit
    assert small_vocab.encode("zebra", special_tokens=False)  # still encodes (rare letters as [UNK])


# ----------------------------------------------------------------------------------------------
# Examples


def test_batch_shapes_layout_and_dtypes(small):
    data, _ = small
    b = data.batch("train", step=0, worker=0, num_workers=1, batch_size=8, seed=0)
    assert set(b) == {"input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label"}
    for k, v in b.items():
        assert v.dtype == torch.int64
        assert v.shape == ((8,) if k == "next_sentence_label" else (8, 64))
    idx = data.indices("train", 0, 0, 1, 8, 0)
    raw = torch.from_numpy(data.train.ids[idx].astype(np.int64))
    for r in range(8):
        n = int(b["attention_mask"][r].sum())
        row = raw[r]
        seps = (row == data.tokenizer.sep_id).nonzero().flatten().tolist()
        assert row[0] == data.tokenizer.cls_id and len(seps) == 2 and seps[1] == n - 1
        assert (row[n:] == data.tokenizer.pad_id).all() and b["attention_mask"][r, :n].all()
        types = b["token_type_ids"][r]
        assert types[:seps[0] + 1].sum() == 0 and types[seps[0] + 1:n].all() and types[n:].sum() == 0
    assert torch.equal(b["next_sentence_label"], torch.from_numpy(data.train.nsp[idx].astype(np.int64)))


def test_nsp_labels_balanced_and_is_next_pairs_consecutive(small):
    data, _ = small
    tc = tokenize_corpus(data.corpus, data.tokenizer, progress=False)
    so, do = tc.sent_offsets, tc.doc_offsets
    docs = [" " + " ".join(map(str, tc.tokens[so[do[d]]:so[do[d + 1]]].tolist())) + " " for d in range(tc.num_docs)]
    ex = data.train
    assert 0.4 < ex.nsp.mean() < 0.65, ex.nsp.mean()
    checked = {0: 0, 1: 0}
    for i in range(len(ex)):
        n, b0 = int(ex.length[i]), int(ex.b_start[i])
        if n == data.seq_len:
            continue  # may have been truncated at either end: adjacency is not visible
        a, b = ex.ids[i, 1:b0 - 1].tolist(), ex.ids[i, b0:n - 1].tolist()
        pair = " " + " ".join(map(str, a + b)) + " "
        contiguous = any(pair in doc for doc in docs)
        assert contiguous == (ex.nsp[i] == 0), (i, ex.nsp[i])
        checked[int(ex.nsp[i])] += 1
    assert min(checked.values()) > 50


def test_eval_documents_are_held_out(small):
    data, _ = small
    assert 0.004 < data.num_eval / (data.num_train + data.num_eval) < 0.03
    # No eval row (A+B text) occurs in any train row.
    train = {" ".join(map(str, data.train.ids[i, :data.train.length[i]])) for i in range(len(data.train))}
    assert not any(" ".join(map(str, data.eval.ids[i, :data.eval.length[i]])) in train for i in range(len(data.eval)))


def test_masking_statistics():
    rng = np.random.default_rng(0)
    vocab, special = 1000, np.arange(5)
    ids = rng.integers(5, vocab, size=(4000, 64))
    length = rng.integers(20, 65, size=4000)
    ids[:, 0] = 2
    ids[np.arange(4000), length - 1] = 3
    ids[np.arange(64)[None, :] >= length[:, None]] = 0
    out, labels = mask_tokens(ids, length, np.random.default_rng(1), 4, special, vocab)
    selected = labels != -100
    candidates = (np.arange(64)[None, :] < length[:, None]) & (ids >= 5)
    assert not (selected & ~candidates).any()  # never a special token or padding
    assert np.array_equal(labels[selected], ids[selected])
    assert abs(selected.sum() / candidates.sum() - 0.15) < 0.005
    per_row = selected.sum(1)
    assert np.all(per_row == np.maximum(1, np.rint(0.15 * candidates.sum(1))))
    masked = (out == 4) & selected
    same = (out == ids) & selected
    changed = selected & ~masked & ~same
    n = selected.sum()
    assert abs(masked.sum() / n - 0.8) < 0.01
    assert abs(same.sum() / n - 0.1) < 0.01  # (+1/995 random draws that hit the original)
    assert abs(changed.sum() / n - 0.1) < 0.01
    assert np.all(out[changed] >= 5) and np.array_equal(out[~selected], ids[~selected])


def test_batch_masks_only_real_tokens(small):
    data, _ = small
    b = data.batch("train", step=3, worker=1, num_workers=2, batch_size=16, seed=5)
    sel = b["labels"] != -100
    idx = data.indices("train", 3, 1, 2, 16, 5)
    raw = torch.from_numpy(data.train.ids[idx].astype(np.int64))
    special = torch.isin(raw, torch.tensor([0, 1, 2, 3, 4]))  # [PAD] [UNK] [CLS] [SEP] [MASK]
    assert not (sel & special).any() and (sel.sum(1) >= 1).all()
    assert torch.equal(b["labels"][sel], raw[sel])
    assert torch.equal(b["input_ids"][~sel], raw[~sel])
    assert 0.1 < sel.sum() / (~special).sum() < 0.2


@pytest.mark.parametrize("prob", [0.15, 0.4, 0.6])
def test_mask_prob_sets_the_share_of_training_tokens_selected(small, prob):
    """--mask-prob: the share selected in training batches (rounded per row); 80/10/10 unchanged;
    the held-out batches keep BERT's 0.15 whatever the training share."""
    data, _ = small
    b = data.batch("train", step=2, worker=0, num_workers=1, batch_size=32, seed=1, mask_prob=prob)
    idx = data.indices("train", 2, 0, 1, 32, 1)
    raw = torch.from_numpy(data.train.ids[idx].astype(np.int64))
    real = ~torch.isin(raw, torch.tensor([0, 1, 2, 3, 4]))
    sel = b["labels"] != -100
    assert abs(float(sel.sum() / real.sum()) - prob) < 0.02
    masked = (b["input_ids"] == 4) & sel  # [MASK] at about 80% of the selected positions
    assert 0.7 < float(masked.sum() / sel.sum()) < 0.9
    ev = next(data.eval_batches(batch_size=32))
    ev_real = (ev["attention_mask"] == 1) & ~torch.isin(ev["input_ids"], torch.tensor([0, 2, 3]))
    assert 0.1 < float((ev["labels"] != -100).sum() / ev_real.sum()) < 0.2
    with pytest.raises(GradzipError, match="mask_prob must be in"):
        data.batch("train", step=0, worker=0, num_workers=1, batch_size=4, mask_prob=1.0)


def test_batches_are_pure_and_sharded_disjointly(small):
    data, root = small
    args = dict(num_workers=3, batch_size=8, seed=11)
    first = data.batch("train", step=5, worker=2, **args)
    for s in range(3):
        data.batch("train", step=s, worker=0, **args)
    again = PretrainData.build(corpus=root / "corpus", seq_len=64, vocab_size=300, cache_dir=root / "cache",
                               progress=False).batch("train", step=5, worker=2, **args)
    assert all(torch.equal(first[k], again[k]) for k in first)
    steps_per_epoch = data.num_train // 24
    seen = [data.indices("train", s, w, **args) for s in range(steps_per_epoch) for w in range(3)]
    flat = np.concatenate(seen)
    assert len(np.unique(flat)) == len(flat)  # disjoint across workers and steps within an epoch
    nxt = data.indices("train", steps_per_epoch, 0, **args)  # next epoch: a new permutation
    assert not np.array_equal(nxt, seen[0])
    other = data.batch("train", step=5, worker=2, num_workers=3, batch_size=8, seed=12)
    assert not torch.equal(other["input_ids"], first["input_ids"])
    with pytest.raises(GradzipError, match="worker 3 of 3"):
        data.batch("train", step=0, worker=3, **args)
    with pytest.raises(GradzipError, match="fewer than one global batch"):
        data.batch("eval", step=0, worker=0, num_workers=4, batch_size=64)


def test_eval_batches_fixed(small):
    data, _ = small
    a = list(data.eval_batches(batch_size=4))
    b = list(data.eval_batches(batch_size=4, max_batches=2))
    assert sum(x["input_ids"].shape[0] for x in a) == data.num_eval
    assert len(b) == 2 and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_eval_set_is_the_same_for_every_seed(small):
    data, root = small
    other = PretrainData.build(corpus=root / "corpus", seq_len=64, vocab_size=300, seed=1, cache_dir=root / "cache",
                               progress=False)
    assert other.directory != data.directory
    assert not np.array_equal(other.train.ids[:50], data.train.ids[:50])  # training pairs follow the seed
    assert np.array_equal(other.eval.ids, data.eval.ids)
    for x, y in zip(other.eval_batches(8), data.eval_batches(8)):
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_examples_are_cached_not_rebuilt(small, monkeypatch):
    data, root = small
    import gradzip.data.examples as ex

    def boom(*a, **k):
        raise AssertionError("re-tokenized or re-segmented")

    monkeypatch.setattr(ex, "_tokenize_into", boom)
    monkeypatch.setattr(ex, "segment", boom)
    monkeypatch.setattr(WordPieceTokenizer, "train", boom)
    again = PretrainData.build(corpus=root / "corpus", seq_len=64, vocab_size=300, cache_dir=root / "cache",
                               progress=False)
    assert np.array_equal(again.train.ids, data.train.ids)
    with pytest.raises(AssertionError, match="re-segmented"):  # a new seq_len is a new segmentation
        PretrainData.build(corpus=root / "corpus", seq_len=32, vocab_size=300, cache_dir=root / "cache",
                           progress=False)


# ----------------------------------------------------------------------------------------------
# The default corpus: the one test that builds it (other tests train on the `corpus` fixture), in
# a cache of its own, never the user's (a user's cache may hold it already, or be in use).


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_corpus(tmp_path, monkeypatch):
    own = tmp_path / "cache"
    monkeypatch.setenv("GRADZIP_CACHE", str(own))
    data = PretrainData.build(progress=False)
    c = data.corpus
    assert c.directory.parent == own / "corpora" and c.directory.name.startswith("default-")
    assert c.source == "default" and c.num_bytes >= 10_000_000
    assert c.fingerprint == hashlib.sha256(c.text_path.read_bytes()).hexdigest()
    lines = [ln for ln in c.text_path.read_text(encoding="utf-8").splitlines() if ln]
    assert not any(ln.startswith(">>>") for ln in lines)
    words = sum(len(ln.split()) for ln in lines)
    assert words / len(lines) > 8  # sentences, not fragments of code
    assert data.vocab_size == 8192 and SPECIAL_TOKENS[0] == "[PAD]"
    assert data.num_train > 20_000 and 0.003 < data.num_eval / (data.num_train + data.num_eval) < 0.03
    b = data.batch("train", step=0, batch_size=4)
    text = data.tokenizer.decode(b["input_ids"][0])
    assert len(text.split()) > 5
    shutil.rmtree(own)  # ~60 MB; pytest keeps the tmp dirs of the last runs


# ----------------------------------------------------------------------------------------------
# Whole-word masking


def _words(raw: np.ndarray, cont: np.ndarray, length: np.ndarray) -> list[list[list[int]]]:
    """Each row's words as lists of positions: a piece and the ## pieces right after it."""
    rows = []
    for r in range(raw.shape[0]):
        words: list[list[int]] = []
        for pos in range(int(length[r])):
            t = raw[r, pos]
            if t < len(SPECIAL_TOKENS):
                words.append([])  # a special token ends the word before it
            elif cont[t] and words and words[-1]:
                words[-1].append(pos)
            else:
                words.append([pos])
        rows.append([w for w in words if w])
    return rows


@pytest.mark.parametrize("prob", [0.15, 0.4])
def test_whole_word_masking_masks_every_piece_of_a_chosen_word(small, prob):
    data, _ = small
    cont = data.tokenizer.continuation_ids()
    assert cont.any() and not cont[:len(SPECIAL_TOKENS)].any()
    assert all(data.tokenizer.tokenizer.id_to_token(i).startswith("##") for i in np.flatnonzero(cont))
    args = dict(step=2, worker=1, num_workers=2, batch_size=32, seed=3, mask_prob=prob)
    b = data.batch("train", whole_word_masking=True, **args)
    assert all(torch.equal(b[k], v) for k, v in data.batch("train", whole_word_masking=True, **args).items())
    idx = data.indices("train", 2, 1, 2, 32, 3)
    raw = data.train.ids[idx].astype(np.int64)
    sel = (b["labels"] != -100).numpy()
    assert np.array_equal(b["labels"].numpy()[sel], raw[sel])
    words = _words(raw, cont, data.train.length[idx])
    multi = 0
    for r, row in enumerate(words):
        n_real = sum(len(w) for w in row)
        budget = max(1, round(prob * n_real))
        assert sel[r].sum() <= budget  # never above BERT's per-row budget
        for w in row:
            assert sel[r, w].all() or not sel[r, w].any(), (r, w)  # all of a word, or none of it
            multi += len(w) > 1 and bool(sel[r, w].all())
    assert multi > 0  # multi-piece words were masked whole
    real = sum(sum(len(w) for w in row) for row in words)
    assert abs(sel.sum() / real - prob) < 0.03  # the rate stays that of --mask-prob
    assert 0.7 < float(((b["input_ids"] == 4) & b["labels"].ne(-100)).sum() / sel.sum()) < 0.9  # 80/10/10


def test_whole_word_masking_leaves_the_default_and_the_held_out_batches(small):
    """Off, the batches are the token-masked ones (bit-identical); on, the held-out batches stay
    token-masked, and the pairs, order and untouched tokens are the same as without it."""
    data, _ = small
    args = dict(step=1, worker=0, num_workers=1, batch_size=16, seed=2)
    plain, off, on = (data.batch("train", **args), data.batch("train", whole_word_masking=False, **args),
                      data.batch("train", whole_word_masking=True, **args))
    assert all(torch.equal(plain[k], off[k]) for k in plain)
    assert not torch.equal(plain["labels"], on["labels"])
    for k in ("token_type_ids", "attention_mask", "next_sentence_label"):
        assert torch.equal(plain[k], on[k])
    ev = [next(data.eval_batches(batch_size=8)) for _ in range(2)]
    assert all(torch.equal(ev[0][k], ev[1][k]) for k in ev[0])


def test_whole_word_masking_needs_word_pieces():
    from tokenizers import Tokenizer, models

    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, "a", "b", "ab"])}
    bpe = WordPieceTokenizer(Tokenizer(models.BPE(vocab, [("a", "b")], unk_token="[UNK]")), "bpe.json")
    with pytest.raises(GradzipError, match="whole-word masking needs a WordPiece tokenizer"):
        bpe.continuation_ids()
