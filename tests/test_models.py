"""BERT model: configs, shapes, HF-compatible names, tied weights, masked-only decoding,
padding mask, init, mixed precision. (Logit parity with transformers: tests/test_hf_parity.py.)"""

import math

import pytest
import torch

from gradzip.errors import GradzipError
from gradzip.models import (
    MODEL_SIZES,
    BertForPreTraining,
    bert_config,
    load_hf_state_dict,
    num_parameters,
    parameter_shapes,
)


def tiny(vocab: int = 500, **kw) -> BertForPreTraining:
    torch.manual_seed(0)
    return BertForPreTraining(bert_config("bert-tiny", vocab_size=vocab, max_position_embeddings=64, **kw))


def inputs(batch: int = 4, seq: int = 32, vocab: int = 500, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    types = torch.zeros_like(ids)
    types[:, seq // 2:] = 1
    mask = torch.ones_like(ids)
    mask[1, seq - 7:] = 0
    ids[mask == 0] = 0
    labels = torch.full_like(ids, -100)
    pick = (torch.rand(ids.shape, generator=g) < 0.15) & (mask == 1)
    labels[pick] = ids[pick]
    nsp = torch.randint(0, 2, (batch,), generator=g)
    return ids, types, mask, labels, nsp


def test_named_sizes_and_overrides():
    expect = {"bert-tiny": (2, 128, 2), "bert-mini": (4, 256, 4), "bert-small": (4, 512, 8),
              "bert-medium": (8, 512, 8), "bert-base": (12, 768, 12), "bert-large": (24, 1024, 16)}
    assert set(MODEL_SIZES) == set(expect)
    for name, (layers, hidden, heads) in expect.items():
        cfg = bert_config(name)
        assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (layers, hidden, heads)
        assert cfg.intermediate_size == 4 * hidden
    cfg = bert_config("bert-base", vocab_size=1234, hidden_dropout_prob=0.0, num_hidden_layers=3)
    assert (cfg.vocab_size, cfg.hidden_dropout_prob, cfg.num_hidden_layers, cfg.hidden_size) == (1234, 0.0, 3, 768)


def test_bad_config_names_list_the_choices():
    with pytest.raises(GradzipError, match="bert-tiny, bert-mini"):
        bert_config("bert-huge")
    with pytest.raises(GradzipError, match="valid fields:.*hidden_size"):
        bert_config("bert-tiny", hiden_size=64)
    with pytest.raises(GradzipError, match="divisible"):
        bert_config("bert-tiny", num_attention_heads=3)


def test_forward_backward_shapes_and_masked_only_decoding():
    model = tiny()
    ids, types, mask, labels, nsp = inputs()
    out = model(ids, types, mask, labels=labels, next_sentence_label=nsp)
    n_masked = int((labels != -100).sum())
    assert n_masked > 0
    assert out.prediction_logits.shape == (n_masked, 500)  # only masked positions were decoded
    assert out.seq_relationship_logits.shape == (4, 2)
    assert out.loss.shape == () and torch.isfinite(out.loss)
    torch.testing.assert_close(out.loss, out.mlm_loss + out.nsp_loss)
    # A fresh model predicts ~uniformly: the MLM loss starts near ln(vocab).
    assert abs(out.mlm_loss.item() - math.log(500)) < 0.5
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_masked_logits_equal_full_logits_at_masked_positions():
    model = tiny().eval()
    ids, types, mask, labels, nsp = inputs(seed=1)
    with torch.no_grad():
        part = model(ids, types, mask, labels=labels)
        full = model(ids, types, mask, labels=labels, full_logits=True)
        none = model(ids, types, mask)
    assert full.prediction_logits.shape == (4, 32, 500)
    torch.testing.assert_close(part.prediction_logits, full.prediction_logits[labels != -100])
    torch.testing.assert_close(part.mlm_loss, full.mlm_loss)
    assert none.loss is None and none.prediction_logits.shape == (4, 32, 500)


def test_no_masked_token_gives_zero_mlm_loss_with_a_graph():
    model = tiny()
    ids, types, mask, _, nsp = inputs()
    out = model(ids, types, mask, labels=torch.full_like(ids, -100), next_sentence_label=nsp)
    assert out.mlm_loss.item() == 0.0
    out.loss.backward()
    assert model.cls.seq_relationship.weight.grad is not None


def test_padding_is_masked():
    """Changing the ids at padded positions must not change any real position's output."""
    model = tiny().eval()
    ids, types, mask, _, _ = inputs(seed=2)
    other = ids.clone()
    other[mask == 0] = 77
    with torch.no_grad():
        a = model(ids, types, mask, full_logits=True).prediction_logits
        b = model(other, types, mask, full_logits=True).prediction_logits
        c = model(other, types, None, full_logits=True).prediction_logits  # no mask: padding is attended
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real])
    assert not torch.allclose(a[1][real[1]], c[1][real[1]])


def test_hf_parameter_names_and_shapes():
    cfg = bert_config("bert-tiny", vocab_size=500)
    model = BertForPreTraining(cfg)
    named = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert named == parameter_shapes(cfg)
    assert list(named) == list(parameter_shapes(cfg))  # same order as named_parameters()
    assert named["bert.embeddings.word_embeddings.weight"] == (500, 128)
    assert named["bert.encoder.layer.0.attention.self.query.weight"] == (128, 128)
    assert named["bert.encoder.layer.1.attention.output.LayerNorm.bias"] == (128,)
    assert named["bert.encoder.layer.1.intermediate.dense.weight"] == (512, 128)
    assert named["bert.encoder.layer.1.output.dense.weight"] == (128, 512)
    assert named["cls.predictions.transform.dense.weight"] == (128, 128)
    assert named["cls.predictions.bias"] == (500,)
    assert named["cls.seq_relationship.weight"] == (2, 128)
    assert named["bert.pooler.dense.weight"] == (128, 128)
    sd = model.state_dict()
    # Tied keys are in the state dict (as in HF) but are one tensor.
    assert sd["cls.predictions.decoder.weight"].data_ptr() == sd["bert.embeddings.word_embeddings.weight"].data_ptr()
    assert sd["cls.predictions.decoder.bias"].data_ptr() == sd["cls.predictions.bias"].data_ptr()
    assert not any("position_ids" in k for k in sd)


def test_tied_embeddings_share_storage_and_gradient():
    model = tiny()
    emb = model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.weight is emb
    assert sum(1 for n, _ in model.named_parameters() if n.endswith("word_embeddings.weight")) == 1
    ids, types, mask, labels, nsp = inputs()
    model(ids, types, mask, labels=labels).loss.backward()
    # The gradient of an id that is never an input but is a decoder output comes from the decoder.
    unused = sorted(set(range(5, 500)) - set(ids.flatten().tolist()))[0]
    assert emb.grad[unused].abs().sum() > 0


def test_load_hf_state_dict_variants_and_errors():
    a, b = tiny(), BertForPreTraining(bert_config("bert-tiny", vocab_size=500, max_position_embeddings=64))
    sd = {k: v.clone() for k, v in a.state_dict().items()}
    # An HF-style dict: buffers present, tied keys saved once, TF-era LayerNorm names.
    sd["bert.embeddings.position_ids"] = torch.arange(64)[None]
    del sd["cls.predictions.decoder.weight"], sd["cls.predictions.decoder.bias"]
    sd["bert.embeddings.LayerNorm.gamma"] = sd.pop("bert.embeddings.LayerNorm.weight")
    load_hf_state_dict(b, sd)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert b.cls.predictions.decoder.weight is b.bert.embeddings.word_embeddings.weight  # still tied
    with pytest.raises(GradzipError, match="missing"):
        load_hf_state_dict(b, {"encoder.weight": torch.zeros(3)})
    wrong = dict(a.state_dict())
    wrong["cls.seq_relationship.bias"] = torch.zeros(3)
    with pytest.raises(GradzipError, match="seq_relationship.bias"):
        load_hf_state_dict(b, wrong)


def test_init_is_bert_like_and_deterministic():
    a, b = tiny(), tiny()
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n
    torch.manual_seed(1)
    c = BertForPreTraining(bert_config("bert-tiny", vocab_size=500, max_position_embeddings=64))
    assert not torch.equal(a.bert.encoder.layer[0].attention.self.query.weight,
                           c.bert.encoder.layer[0].attention.self.query.weight)
    w = a.bert.encoder.layer[0].intermediate.dense.weight
    assert abs(w.std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 0.001
    assert torch.count_nonzero(a.bert.encoder.layer[0].intermediate.dense.bias) == 0
    assert torch.all(a.bert.encoder.layer[1].output.LayerNorm.weight == 1)
    assert torch.count_nonzero(a.cls.predictions.bias) == 0
    assert torch.count_nonzero(a.bert.embeddings.word_embeddings.weight[0]) == 0  # [PAD] row


def test_bf16_autocast_on_cpu():
    model = tiny()
    ids, types, mask, labels, nsp = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, types, mask, labels=labels, next_sentence_label=nsp)
    assert out.prediction_logits.dtype == torch.bfloat16
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    ref = model(ids, types, mask, labels=labels, next_sentence_label=nsp).loss
    assert abs(out.loss.item() - ref.item()) < 0.05  # bf16 has ~3 significant digits
    out.loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_parameter_counts_of_the_named_sizes():
    # Published sizes: BERT-base ~110M, BERT-large ~340M (Devlin et al. 2019); with the MLM and
    # NSP heads Hugging Face's BertForPreTraining has 110,106,428 and 336,226,108 parameters.
    base, large = num_parameters(bert_config("bert-base")), num_parameters(bert_config("bert-large"))
    assert abs(base - 110_106_428) / 110e6 < 0.005
    assert abs(large - 336_226_108) / 336e6 < 0.005
    cfg = bert_config("bert-tiny", vocab_size=500)
    assert num_parameters(cfg) == sum(p.numel() for p in BertForPreTraining(cfg).parameters())


# ----------------------------------------------------------------------------------------------
# Pre-LN blocks (--pre-ln): RobertaPreLayerNorm's architecture


def _pre_ln_reference(model: BertForPreTraining, ids, types, mask):
    """Pre-LN BERT written out from the weights: LN before attention and feed-forward, residual
    added after, a final LN after the last layer, then BERT's MLM transform and tied decoder."""
    w = {k: v.detach() for k, v in model.state_dict().items()}
    cfg = model.config
    eps, h, heads = cfg.layer_norm_eps, cfg.hidden_size, cfg.num_attention_heads

    def ln(x, name):
        return torch.nn.functional.layer_norm(x, (h,), w[name + ".weight"], w[name + ".bias"], eps)

    def lin(x, name):
        return x @ w[name + ".weight"].T + w[name + ".bias"]

    b, s = ids.shape
    x = w["bert.embeddings.word_embeddings.weight"][ids] + w["bert.embeddings.position_embeddings.weight"][:s] \
        + w["bert.embeddings.token_type_embeddings.weight"][types]
    x = ln(x, "bert.embeddings.LayerNorm")
    bias = torch.where(mask.bool(), 0.0, float("-inf"))[:, None, None, :]
    for n in range(cfg.num_hidden_layers):
        p = f"bert.encoder.layer.{n}."
        y = ln(x, p + "attention.LayerNorm")
        q, k, v = (lin(y, p + f"attention.self.{m}").view(b, s, heads, h // heads).transpose(1, 2)
                   for m in ("query", "key", "value"))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(h // heads) + bias, dim=-1) @ v
        x = x + lin(att.transpose(1, 2).reshape(b, s, h), p + "attention.output.dense")
        y = torch.nn.functional.gelu(lin(ln(x, p + "intermediate.LayerNorm"), p + "intermediate.dense"))
        x = x + lin(y, p + "output.dense")
    x = ln(x, "bert.LayerNorm")
    t = ln(torch.nn.functional.gelu(lin(x, "cls.predictions.transform.dense")), "cls.predictions.transform.LayerNorm")
    logits = t @ w["bert.embeddings.word_embeddings.weight"].T + w["cls.predictions.bias"]
    nsp = lin(torch.tanh(lin(x[:, 0], "bert.pooler.dense")), "cls.seq_relationship")
    return logits, nsp


def test_pre_ln_forward_equals_a_hand_written_reference():
    model = tiny(pre_layer_norm=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).eval()
    with torch.no_grad():  # LayerNorms and biases away from (1, 0), so that a mis-wired one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    ids, types, mask, _, _ = inputs(seed=4)
    with torch.no_grad():
        out = model(ids, types, mask, full_logits=True)
        logits, nsp = _pre_ln_reference(model, ids, types, mask)
    real = mask.bool()
    torch.testing.assert_close(out.prediction_logits[real], logits[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.seq_relationship_logits, nsp, rtol=0, atol=1e-5)


def test_pre_ln_names_shapes_and_default():
    """Pre-LN moves the LayerNorms (attention.LayerNorm, intermediate.LayerNorm, bert.LayerNorm,
    RobertaPreLayerNorm's places); parameter_shapes follows; the default stays post-LN."""
    assert bert_config("bert-tiny").pre_layer_norm is False
    cfg = bert_config("bert-tiny", vocab_size=500, pre_layer_norm=True)
    model = BertForPreTraining(cfg)
    named = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert list(named.items()) == list(parameter_shapes(cfg).items())
    norms = sorted(n for n in named if "LayerNorm.weight" in n)
    layers = [f"bert.encoder.layer.{n}.{m}.LayerNorm.weight" for n in (0, 1) for m in ("attention", "intermediate")]
    assert norms == ["bert.LayerNorm.weight", "bert.embeddings.LayerNorm.weight", *layers,
                     "cls.predictions.transform.LayerNorm.weight"]
    post = bert_config("bert-tiny", vocab_size=500)
    # two LayerNorms per layer either way; pre-LN adds the final one
    assert num_parameters(cfg) == num_parameters(post) + 2 * 128
