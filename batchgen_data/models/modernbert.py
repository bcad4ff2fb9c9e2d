"""ModernBERT encoders (gte-modernbert, nomic's and Alibaba's ModernBERT embedders and rerankers),
over packed varlen batches.

Mirrors HF's `modeling_modernbert.py`: pre-LayerNorm layers (none before the first layer's
attention), one fused `Wqkv` projection, rotary positions (theta per layer type), a gated MLP
(`Wi` gives input and gate, `act(input) * gate`), and layers that alternate between global
attention and a bidirectional sliding window (`local_attention` tokens wide: a token sees those
at most `local_attention // 2` positions away; `layer_types`, or every
`global_attn_every_n_layers`-th layer global in older configs). Bias and LayerNorm-bias flags as
the config says. The model takes a step's tokens as one packed batch with each request's length
and returns the final-normed hidden states [T, hidden], as `bert.py`'s encoders do.
`ModernBertForSequenceClassification` maps the CLS row through the prediction head (dense, act,
LayerNorm) to logits; `classifier_pooling="mean"` is refused (the pooling runner hands the
heads one row per request).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from batchgen_data.layers.linear import Linear
from batchgen_data.layers.pooler import varlen_attention
from batchgen_data.layers.rotary import RotaryEmbedding
from batchgen_data.models.bert import ACTIVATIONS


def _act(name: str) -> Any:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def layer_types(config: Any) -> list[str]:
    """"full_attention" or "sliding_attention" per layer."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds)
    every = getattr(config, "global_attn_every_n_layers", 3)
    return ["sliding_attention" if i % every else "full_attention"
            for i in range(config.num_hidden_layers)]


def rope_config(config: Any, kind: str) -> SimpleNamespace:
    """The rotary settings of one layer type, as `layers.rotary` reads a config: transformers
    5's `rope_parameters[kind]`, else the older `global_rope_theta` / `local_rope_theta`."""
    params = getattr(config, "rope_parameters", None) or {}
    mine = dict(params.get(kind) or {}) if isinstance(params, dict) else {}
    if "rope_theta" not in mine:
        mine["rope_theta"] = float(getattr(config, "global_rope_theta", 160_000.0)
                                   if kind == "full_attention"
                                   else getattr(config, "local_rope_theta", 10_000.0))
    return SimpleNamespace(rope_parameters=mine,
                           max_position_embeddings=config.max_position_embeddings)


class ModernBertAttention(nn.Module):
    def __init__(self, config: Any, kind: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.Wqkv = Linear(hidden, 3 * hidden, bias=bias)
        self.Wo = Linear(hidden, hidden, bias=bias)
        self.window = config.local_attention // 2 if kind == "sliding_attention" else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, lens: list[int],
                rotary: RotaryEmbedding) -> torch.Tensor:
        q, k, v = self.Wqkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotary(positions, q, k)
        o = varlen_attention(q, k, v, lens, self.head_dim ** -0.5, window=self.window)
        return self.Wo(o.flatten(1))


class ModernBertMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.Wi = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.Wo = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = _act(config.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(up) * gate)


def _norm(config: Any) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps,
                        bias=bool(getattr(config, "norm_bias", False)))


class ModernBertLayer(nn.Module):
    def __init__(self, config: Any, index: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.attn_norm = nn.Identity() if index == 0 else _norm(config)
        self.attn = ModernBertAttention(config, kind)
        self.mlp_norm = _norm(config)
        self.mlp = ModernBertMLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, lens: list[int],
                rotary: RotaryEmbedding) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, lens, rotary)
        return x + self.mlp(self.mlp_norm(x))


class _Embeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = _norm(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertModel(nn.Module):
    """The encoder stack; `forward` returns the final-normed hidden states of a packed batch."""

    is_encoder = True
    # how `encoder_weights.load_encoder_weights` reads a checkpoint: the base's prefix in a
    # model saved with a head, and the heads it does not use
    checkpoint_prefixes = ("model.",)
    foreign_heads = ("head.", "decoder.")

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        kinds = layer_types(config)
        if len(kinds) != config.num_hidden_layers:
            raise ValueError(f"layer_types has {len(kinds)} entries for "
                             f"{config.num_hidden_layers} layers")
        self.embeddings = _Embeddings(config)
        self.layers = nn.ModuleList(ModernBertLayer(config, i, kind)
                                    for i, kind in enumerate(kinds))
        self.final_norm = _norm(config)
        # one rotary table per layer type, shared by its layers (cos/sin looked up once a step)
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(rope_config(config, kind), head_dim,
                                                           config.max_position_embeddings)
                                     for kind in dict.fromkeys(kinds)})
        self.pooler = None  # no BERT pooler (encoder_weights.load_encoder_weights asks)

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """input_ids/positions [T] for requests of `lens` tokens -> [T, hidden]
        (`token_type_ids`: ModernBERT has none)."""
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, positions, lens, self.rotary[layer.kind])
        return self.final_norm(x)


class _PredictionHead(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size,
                            bias=bool(getattr(config, "classifier_bias", False)))
        self.act = _act(getattr(config, "classifier_activation", "gelu"))
        self.norm = _norm(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertForSequenceClassification(nn.Module):
    """logits = classifier(head(CLS row)), as HF's with `classifier_pooling="cls"`."""

    is_encoder = True
    base_prefix = "model"

    def __init__(self, config: Any) -> None:
        super().__init__()
        pooling = getattr(config, "classifier_pooling", "cls")
        if pooling != "cls":
            raise ValueError(f"classifier_pooling={pooling!r}: only 'cls' is supported for "
                             "ModernBertForSequenceClassification")
        self.config = config
        self.model = ModernBertModel(config)
        self.num_labels = config.num_labels
        self.head = _PredictionHead(config)
        self.classifier = Linear(config.hidden_size, config.num_labels, bias=True)

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    def forward(self, *args: Any) -> torch.Tensor:
        return self.model(*args)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head(cls_rows)).float()
