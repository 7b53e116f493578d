"""BERT for masked-LM + next-sentence pretraining (Devlin et al., 2019).

Parameter names and shapes are those of Hugging Face ``transformers.BertForPreTraining``, so a
state dict saved by transformers loads with :func:`load_hf_state_dict` (and ``model.state_dict()``
loads into transformers). Differences from the HF implementation, none of which changes the maths:

- attention is :func:`torch.nn.functional.scaled_dot_product_attention` with a boolean padding
  mask (fused kernels on CPU and CUDA, no materialised attention matrix);
- with ``labels`` given, only the masked positions (``labels != -100``) go through the MLM
  transform and the vocabulary projection. With 15% masking this skips ~85% of the largest matmul
  of the model (hidden x vocab), the biggest single saving for small BERTs with a 30k vocabulary;
- no ``position_ids``/``token_type_ids`` buffers (positions are ``arange``), so the state dict has
  only parameters; :func:`load_hf_state_dict` drops those buffers from HF state dicts.

``BertConfig(pre_layer_norm=True)`` builds pre-LN blocks instead, the architecture of Hugging Face's
``RobertaPreLayerNorm*`` models: each layer normalises its input before the attention
(``attention.LayerNorm``) and before the feed-forward (``intermediate.LayerNorm``) and adds the
residual after, unnormalised; ``bert.LayerNorm`` normalises the last layer's output (before the
pooler and the heads). The embeddings and the heads are unchanged. ``gradzip export`` renames the
weights to RobertaPreLayerNorm's (:mod:`gradzip.training.export`).

Mixed precision: the model runs under ``torch.autocast`` (bf16 on CPU, fp16 or bf16 on CUDA);
losses are computed in fp32 from the (autocast) logits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradzip.errors import GradzipError

IGNORE_INDEX = -100  # label value of unmasked positions (as HF / torch cross_entropy)


@dataclass
class BertConfig:
    """Hyper-parameters of a BERT model. Field names follow HF ``BertConfig``."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"  # "gelu" (erf, as BERT), "gelu_tanh" or "relu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    pre_layer_norm: bool = False  # not an HF BertConfig field: pre-LN blocks (RobertaPreLayerNorm's)

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "max_position_embeddings", "type_vocab_size"):
            if int(getattr(self, f)) < 1:
                raise GradzipError(f"BertConfig.{f} must be >= 1, got {getattr(self, f)}")
        if self.hidden_size % self.num_attention_heads:
            raise GradzipError(f"BertConfig: hidden_size {self.hidden_size} is not divisible by "
                               f"num_attention_heads {self.num_attention_heads}; pick a divisor")
        for f in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0.0 <= float(getattr(self, f)) < 1.0:
                raise GradzipError(f"BertConfig.{f} must be in [0, 1), got {getattr(self, f)}")
        if self.hidden_act not in _ACTIVATIONS:
            raise GradzipError(f"BertConfig.hidden_act {self.hidden_act!r} is not one of {sorted(_ACTIVATIONS)}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise GradzipError(f"BertConfig.pad_token_id {self.pad_token_id} is outside [0, vocab_size)")


_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}

# name -> (layers, hidden, heads, default vocabulary). Sizes as in Turc et al. 2019 ("Well-read
# students learn better") and the original BERT; intermediate = 4 x hidden. The vocabulary default
# is what `gradzip train` asks the tokenizer for: small models cannot use a 30k vocabulary well on
# a ~10 MB corpus, and the vocabulary projection would dominate their compute.
MODEL_SIZES: dict[str, tuple[int, int, int, int]] = {
    "bert-tiny": (2, 128, 2, 8192),
    "bert-mini": (4, 256, 4, 8192),
    "bert-small": (4, 512, 8, 16384),
    "bert-medium": (8, 512, 8, 16384),
    "bert-base": (12, 768, 12, 30522),
    "bert-large": (24, 1024, 16, 30522),
}


def bert_config(name: str, **overrides: object) -> BertConfig:
    """The named configuration with ``overrides`` applied, e.g.
    ``bert_config("bert-tiny", vocab_size=8192, hidden_dropout_prob=0.0)``."""
    if name not in MODEL_SIZES:
        raise GradzipError(f"unknown model {name!r}; choose one of {', '.join(MODEL_SIZES)}")
    layers, hidden, heads, vocab = MODEL_SIZES[name]
    fields = {f.name for f in dataclasses.fields(BertConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise GradzipError(f"unknown BertConfig field(s) {', '.join(unknown)}; "
                           f"valid fields: {', '.join(sorted(fields))}")
    base = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                intermediate_size=4 * hidden)
    base.update(overrides)
    return BertConfig(**base)  # type: ignore[arg-type]


def parameter_shapes(cfg: BertConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every trainable tensor, in ``named_parameters()`` order (tied decoder
    weight and bias appear once, under their owners), without allocating the model: the cluster
    simulator uses it to size gradients of bert-large on a laptop."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "bert.embeddings.word_embeddings.weight": (v, h),
        "bert.embeddings.position_embeddings.weight": (cfg.max_position_embeddings, h),
        "bert.embeddings.token_type_embeddings.weight": (cfg.type_vocab_size, h),
        "bert.embeddings.LayerNorm.weight": (h,),
        "bert.embeddings.LayerNorm.bias": (h,),
    }
    for n in range(cfg.num_hidden_layers):
        p = f"bert.encoder.layer.{n}."
        for lin, (out_f, in_f) in (("attention.self.query", (h, h)), ("attention.self.key", (h, h)),
                                   ("attention.self.value", (h, h)), ("attention.output.dense", (h, h))):
            shapes[p + lin + ".weight"] = (out_f, in_f)
            shapes[p + lin + ".bias"] = (out_f,)
        norms = ("attention.LayerNorm", "intermediate.LayerNorm") if cfg.pre_layer_norm else \
            ("attention.output.LayerNorm",)
        for norm in norms:
            shapes[p + norm + ".weight"] = (h,)
            shapes[p + norm + ".bias"] = (h,)
        shapes[p + "intermediate.dense.weight"] = (i, h)
        shapes[p + "intermediate.dense.bias"] = (i,)
        shapes[p + "output.dense.weight"] = (h, i)
        shapes[p + "output.dense.bias"] = (h,)
        if not cfg.pre_layer_norm:
            shapes[p + "output.LayerNorm.weight"] = (h,)
            shapes[p + "output.LayerNorm.bias"] = (h,)
    if cfg.pre_layer_norm:  # the final LayerNorm after the last layer
        shapes["bert.LayerNorm.weight"] = (h,)
        shapes["bert.LayerNorm.bias"] = (h,)
    shapes.update({
        "bert.pooler.dense.weight": (h, h),
        "bert.pooler.dense.bias": (h,),
        "cls.predictions.bias": (v,),
        "cls.predictions.transform.dense.weight": (h, h),
        "cls.predictions.transform.dense.bias": (h,),
        "cls.predictions.transform.LayerNorm.weight": (h,),
        "cls.predictions.transform.LayerNorm.bias": (h,),
        "cls.seq_relationship.weight": (2, h),
        "cls.seq_relationship.bias": (2,),
    })
    return shapes


def num_parameters(cfg: BertConfig) -> int:
    """Number of trainable parameters (tied weights counted once), from the config alone."""
    return sum(math.prod(s) for s in parameter_shapes(cfg).values())


@dataclass
class BertPreTrainingOutput:
    """``loss = mlm_loss + nsp_loss`` (whichever labels were given; None without labels).

    ``prediction_logits`` is ``(num_masked, vocab)`` for the positions with ``labels != -100``, in
    row-major (batch, position) order, when labels are given; ``(batch, seq, vocab)`` without
    labels or with ``full_logits=True``."""

    loss: Tensor | None
    mlm_loss: Tensor | None
    nsp_loss: Tensor | None
    prediction_logits: Tensor
    seq_relationship_logits: Tensor


class _Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings(
            token_type_ids)
        return self.dropout(self.LayerNorm(x))


class _SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout_p = cfg.attention_probs_dropout_prob

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        b, s, h = x.shape

        def heads(t: Tensor) -> Tensor:  # (b, s, h) -> (b, heads, s, h / heads)
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)), heads(self.value(x)),
                                             attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0)
        return out.transpose(1, 2).reshape(b, s, h)


class _DenseNorm(nn.Module):
    """dense -> dropout -> residual add -> LayerNorm (HF's BertSelfOutput / BertOutput); pre-LN
    blocks leave out the LayerNorm (RobertaPreLayerNormSelfOutput / -Output)."""

    def __init__(self, cfg: BertConfig, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = None if cfg.pre_layer_norm else nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        x = self.dropout(self.dense(x)) + residual
        return x if self.LayerNorm is None else self.LayerNorm(x)


class _Attention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.self = _SelfAttention(cfg)
        self.output = _DenseNorm(cfg, cfg.hidden_size)
        # pre-LN: the attention reads its normalised input, the residual is the raw one
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps) if cfg.pre_layer_norm else None

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        return self.output(self.self(x if self.LayerNorm is None else self.LayerNorm(x), mask), x)


class _Intermediate(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps) if cfg.pre_layer_norm else None
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.dense(x if self.LayerNorm is None else self.LayerNorm(x)))


class _Layer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = _Attention(cfg)
        self.intermediate = _Intermediate(cfg)
        self.output = _DenseNorm(cfg, cfg.intermediate_size)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        for layer in self.layer:
            x = layer(x, mask)
        return x


class _Pooler(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.dense(x[:, 0]))


class BertModel(nn.Module):
    """The encoder: embeddings, transformer layers, pooler (HF ``BertModel``; pre-LN: with the
    final ``LayerNorm`` of ``RobertaPreLayerNormModel`` before the pooler)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)
        # pre-LN: the residual stream is never normalised inside the layers, so once at the end
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps) if cfg.pre_layer_norm else None
        self.pooler = _Pooler(cfg)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor,
                attention_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        mask = None
        if attention_mask is not None:
            # (b, 1, 1, s) boolean: True = attend. Broadcast over heads and query positions.
            mask = attention_mask.to(torch.bool)[:, None, None, :]
        x = self.encoder(self.embeddings(input_ids, token_type_ids), mask)
        if self.LayerNorm is not None:
            x = self.LayerNorm(x)
        return x, self.pooler(x)


class _Transform(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class _LMPredictionHead(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.transform = _Transform(cfg)
        # The decoder weight is tied to the word embeddings (set by BertForPreTraining) and its bias
        # is `self.bias`, as in HF, so both state-dict keys exist and alias.
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.decoder.bias = self.bias

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.transform(x))


class _PreTrainingHeads(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.predictions = _LMPredictionHead(cfg)
        self.seq_relationship = nn.Linear(cfg.hidden_size, 2)


class BertForPreTraining(nn.Module):
    """BERT with the masked-LM and next-sentence heads.

    ``forward(input_ids, token_type_ids=None, attention_mask=None, labels=None,
    next_sentence_label=None, full_logits=False)``:

    - ``input_ids``, ``token_type_ids``, ``attention_mask`` (1 = token, 0 = padding): ``(batch, seq)``
      integer tensors. Missing token types are 0; a missing mask attends to every position.
    - ``labels``: ``(batch, seq)`` target ids at masked positions, -100 elsewhere.
    - ``next_sentence_label``: ``(batch,)``, 0 = B follows A, 1 = B is random (HF convention).

    Only masked positions are decoded unless ``full_logits=True`` (for parity tests and
    inspection). Initialisation is BERT's: N(0, 0.02) weights, zero biases, LayerNorm (1, 0);
    deterministic under ``torch.manual_seed``.
    """

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.bert = BertModel(cfg)
        self.cls = _PreTrainingHeads(cfg)
        self.apply(self._init_weights)
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def _init_weights(self, m: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(m, nn.Linear):
            if m is self.cls.predictions.decoder:  # tied: initialised as the embedding
                return
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, _LMPredictionHead):
            nn.init.zeros_(m.bias)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None, next_sentence_label: Tensor | None = None,
                full_logits: bool = False) -> BertPreTrainingOutput:
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        seq, pooled = self.bert(input_ids, token_type_ids, attention_mask)
        nsp_logits = self.cls.seq_relationship(pooled)

        mlm_loss = nsp_loss = None
        if labels is not None and not full_logits:
            # Gather first: the vocabulary projection only for the ~15% of positions with a target.
            selected = labels != IGNORE_INDEX
            logits = self.cls.predictions(seq[selected])
            targets = labels[selected]
        else:
            logits = self.cls.predictions(seq)
            targets = labels
        if labels is not None:
            assert targets is not None
            flat = logits.reshape(-1, logits.shape[-1]).float()
            if targets.numel() and bool((targets != IGNORE_INDEX).any()):
                mlm_loss = F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX)
            else:  # no masked token in the batch: a zero loss that still has a graph
                mlm_loss = flat.sum() * 0.0
        if next_sentence_label is not None:
            nsp_loss = F.cross_entropy(nsp_logits.float(), next_sentence_label.reshape(-1))
        parts = [x for x in (mlm_loss, nsp_loss) if x is not None]
        loss = sum(parts[1:], parts[0]) if parts else None
        return BertPreTrainingOutput(loss, mlm_loss, nsp_loss, logits, nsp_logits)


# State-dict keys that HF checkpoints may carry and this model derives or does not keep.
_HF_BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")
_TIED = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
         "cls.predictions.decoder.bias": "cls.predictions.bias"}


def load_hf_state_dict(model: BertForPreTraining, state_dict: Mapping[str, Tensor]) -> None:
    """Load a ``transformers.BertForPreTraining`` state dict strictly.

    Handles what HF checkpoints vary in: the ``position_ids``/``token_type_ids`` buffers (dropped),
    tied keys saved once (the decoder weight/bias are filled from their owners), TF-era LayerNorm
    names ``gamma``/``beta``, and a missing ``bert.``/``cls.`` prefix is *not* guessed: a foreign
    state dict gives a :class:`GradzipError` naming missing and unexpected keys.
    """
    sd: dict[str, Tensor] = {}
    for k, v in state_dict.items():
        if k in _HF_BUFFERS:
            continue
        if k.endswith(".gamma"):
            k = k[: -len("gamma")] + "weight"
        elif k.endswith(".beta"):
            k = k[: -len("beta")] + "bias"
        sd[k] = v
    for alias, owner in _TIED.items():
        if alias not in sd and owner in sd:
            sd[alias] = sd[owner]
        elif owner not in sd and alias in sd:
            sd[owner] = sd[alias]
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise GradzipError(f"state dict does not fit BertForPreTraining: missing {missing[:5]}"
                           f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                           f"{'...' if len(unexpected) > 5 else ''}")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrong = [f"{k} {tuple(sd[k].shape)} != {shapes[k]}" for k in shapes if tuple(sd[k].shape) != shapes[k]]
    if wrong:
        raise GradzipError(f"state dict shapes do not match the config: {'; '.join(wrong[:3])}")
    model.load_state_dict(sd, strict=True)
