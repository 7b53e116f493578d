"""The models ``gradzip simulate`` can size: every BERT of :data:`gradzip.models.MODEL_SIZES`, and
decoder-only LLaMA-style models described by their shapes alone (nothing here can be trained).

The cost model needs only each trainable tensor's shape, in ``named_parameters()`` order: the
engine's buckets and every per-tensor codec (``sparseloco`` chunks each tensor on its own sides)
follow from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradzip.errors import GradzipError
from gradzip.models import MODEL_SIZES, bert_config, parameter_shapes


@dataclass(frozen=True)
class DecoderShape:
    """A LLaMA-style decoder (Hugging Face ``LlamaForCausalLM``): grouped-query attention, a gated
    MLP, RMSNorm without bias, untied input and output embeddings."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    def shapes(self, vocab: int | None = None) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every trainable tensor (``vocab`` overrides the vocabulary size)."""
        h, i, v = self.hidden, self.intermediate, vocab or self.vocab
        kv = self.kv_heads * (h // self.heads)
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                        p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                        p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                        p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                        p + "post_attention_layernorm.weight": (h,)})
        out.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
        return out


# Llama-3-70B's published configuration (70.6 B parameters): 80 layers, hidden 8192, 64 heads of
# which 8 key/value heads, MLP 28672, vocabulary 128256.
DECODERS: dict[str, DecoderShape] = {
    "llama-70b": DecoderShape(layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=128256),
}
MODELS: tuple[str, ...] = (*MODEL_SIZES, *DECODERS)


def model_shapes(model: str, vocab_size: int | None = None) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every trainable tensor of ``model`` (one of :data:`MODELS`), with its
    vocabulary overridden by ``vocab_size``; a one-line error for an unknown name."""
    if model in DECODERS:
        return DECODERS[model].shapes(vocab_size)
    if model not in MODEL_SIZES:
        raise GradzipError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    cfg = bert_config(model) if vocab_size is None else bert_config(model, vocab_size=vocab_size)
    return parameter_shapes(cfg)
