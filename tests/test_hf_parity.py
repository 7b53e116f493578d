"""Parity with Hugging Face ``transformers.BertForPreTraining`` (the ``hf`` extra).

A small random HF model is built offline from a config (no download); its state dict is loaded
into ours, and both must give the same logits to 1e-5 in fp32 eval mode, including padding.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the HF parity test needs `pip install gradzip[hf]`")

from gradzip.models import BertForPreTraining, bert_config, load_hf_state_dict  # noqa: E402


def _pair(seed: int = 0):
    hf_cfg = transformers.BertConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=40, type_vocab_size=2,
                                     hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0)
    torch.manual_seed(seed)
    hf = transformers.BertForPreTraining(hf_cfg).eval()
    ours = BertForPreTraining(bert_config("bert-tiny", vocab_size=97, hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=128,
                                          max_position_embeddings=40)).eval()
    # Perturb biases and LayerNorms away from their zero/one init, so that a mis-wired bias or norm
    # cannot hide behind the initial values.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    load_hf_state_dict(ours, hf.state_dict())
    return hf, ours


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 97, (3, 24), generator=g)
    types = torch.zeros_like(ids)
    types[:, 12:] = 1
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0  # padded rows: the masking convention must agree too
    mask[2, 10:] = 0
    ids[mask == 0] = 0
    return ids, types, mask


def test_logits_match_hf():
    hf, ours = _pair()
    ids, types, mask = _inputs()
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
        out = ours(ids, types, mask, full_logits=True)
    assert out.prediction_logits.shape == ref.prediction_logits.shape
    torch.testing.assert_close(out.prediction_logits, ref.prediction_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.seq_relationship_logits, ref.seq_relationship_logits, rtol=0, atol=1e-5)


def test_losses_and_masked_logits_match_hf():
    hf, ours = _pair(seed=3)
    ids, types, mask = _inputs()
    labels = torch.full_like(ids, -100)
    labels[0, [1, 5, 9]] = ids[0, [1, 5, 9]]
    labels[2, 3] = 7
    nsp = torch.tensor([0, 1, 0])
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels, next_sentence_label=nsp)
        out = ours(ids, types, mask, labels=labels, next_sentence_label=nsp)
    # Ours decodes only the 4 masked positions; they equal HF's full logits at those positions.
    torch.testing.assert_close(out.prediction_logits, ref.prediction_logits[labels != -100], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=1e-5)


def test_our_state_dict_loads_into_hf():
    hf, ours = _pair(seed=5)
    fresh = transformers.BertForPreTraining(hf.config).eval()
    missing, unexpected = fresh.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected
    assert all(k.endswith(("position_ids", "token_type_ids")) for k in missing)
    ids, types, mask = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids, token_type_ids=types, attention_mask=mask).prediction_logits,
                                   hf(input_ids=ids, token_type_ids=types, attention_mask=mask).prediction_logits,
                                   rtol=0, atol=1e-5)
