"""BERT and XLM-RoBERTa encoders (BGE, GTE, E5, multilingual-e5...), over packed varlen batches.

Mirrors HF's `modeling_bert.py` / `modeling_xlm_roberta.py`: absolute position embeddings,
token-type embeddings, post-LayerNorm layers, bidirectional attention. The q|k|v projections
are fused into one matmul (`attention.qkv`, filled from the checkpoint's query/key/value by
`encoder_weights.py`). The model takes a step's tokens as one packed batch (the requests one
after another, no padding) with each request's length, and returns hidden states [T, hidden].
XLM-RoBERTa differs in its positions: they start after `pad_token_id` (HF's
`create_position_ids_from_input_ids`), and pad tokens take position `pad_token_id`.
The heads: `*ForSequenceClassification` maps a request's CLS row to logits.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchgen_data.layers.linear import Linear, MergedLinear
from batchgen_data.layers.pooler import varlen_attention

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu,
         "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class EncoderShape:
    def __init__(self, config: Any) -> None:
        self.hidden = config.hidden_size
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden // self.num_heads
        self.intermediate = config.intermediate_size
        self.vocab = config.vocab_size
        self.eps = config.layer_norm_eps
        self.max_positions = config.max_position_embeddings
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported; "
                             f"supported: {sorted(ACTIVATIONS)}")
        self.act = config.hidden_act
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type={config.position_embedding_type!r}: "
                             "only absolute position embeddings are supported")


class Embeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        x = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
             + self.position_embeddings(positions))
        return self.LayerNorm(x)


class _Dense(nn.Module):
    """`dense` followed by `LayerNorm` over the residual (HF's BertSelfOutput / BertOutput)."""

    def __init__(self, d_in: int, d_out: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(d_in, d_out, bias=True)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class EncoderAttention(nn.Module):
    def __init__(self, s: EncoderShape) -> None:
        super().__init__()
        self.num_heads, self.head_dim = s.num_heads, s.head_dim
        self.qkv = MergedLinear(s.hidden, [s.hidden] * 3, bias=True)
        self.output = _Dense(s.hidden, s.hidden, s.eps)
        self.scale = 1.0 / math.sqrt(s.head_dim)

    def forward(self, x: torch.Tensor, lens: list[int]) -> torch.Tensor:
        q, k, v = (t.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
                   for t in self.qkv(x).chunk(3, dim=-1))
        o = varlen_attention(q, k, v, lens, self.scale)
        return self.output(o.flatten(1), x)


class _Intermediate(nn.Module):
    def __init__(self, s: EncoderShape) -> None:
        super().__init__()
        self.dense = Linear(s.hidden, s.intermediate, bias=True)
        self.act = ACTIVATIONS[s.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class EncoderLayer(nn.Module):
    def __init__(self, s: EncoderShape) -> None:
        super().__init__()
        self.attention = EncoderAttention(s)
        self.intermediate = _Intermediate(s)
        self.output = _Dense(s.intermediate, s.hidden, s.eps)

    def forward(self, x: torch.Tensor, lens: list[int]) -> torch.Tensor:
        x = self.attention(x, lens)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, s: EncoderShape) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(s) for _ in range(s.num_layers))


class _Pooler(nn.Module):
    """BERT's pooler: tanh(dense(CLS row)); its classification head reads it."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = Linear(hidden, hidden, bias=True)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_rows))


class BertModel(nn.Module):
    """The encoder stack; `forward` returns the last hidden states of a packed batch."""

    is_encoder = True
    position_offset = False  # XLM-RoBERTa: positions start after pad_token_id

    def __init__(self, config: Any, add_pooling_layer: bool = True) -> None:
        super().__init__()
        self.config = config
        self.shape = s = EncoderShape(config)
        self.pad_token_id = getattr(config, "pad_token_id", None)
        self.embeddings = Embeddings(config)
        self.encoder = _Encoder(s)
        self.pooler = _Pooler(s.hidden) if add_pooling_layer else None

    @property
    def max_model_len(self) -> int:
        if self.position_offset:
            return self.shape.max_positions - (self.pad_token_id or 0) - 1
        return self.shape.max_positions

    def positions_for(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      lens: list[int]) -> torch.Tensor:
        """Position-embedding rows: the token's index in its request; XLM-RoBERTa's count
        only non-pad tokens and start after the pad id (pad tokens sit at the pad id)."""
        if not self.position_offset:
            return positions
        pad = self.pad_token_id or 0
        real = (input_ids != pad).long()
        run = torch.cumsum(real, 0)
        seq_start = torch.repeat_interleave(
            run.new_tensor([0] + lens[:-1]).cumsum(0), run.new_tensor(lens))
        before = torch.cat([run.new_zeros(1), run])[seq_start]  # real tokens before each seq
        return (run - before) * real + pad

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """input_ids/positions/token_type_ids [T] for requests of `lens` tokens -> [T, hidden]."""
        x = self.embeddings(input_ids, self.positions_for(input_ids, positions, lens),
                            token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, lens)
        return x


class XLMRobertaModel(BertModel):
    position_offset = True

    def __init__(self, config: Any, add_pooling_layer: bool = True) -> None:
        super().__init__(config, add_pooling_layer)


class BertForSequenceClassification(nn.Module):
    """logits = classifier(pooler(CLS row)), as HF's."""

    is_encoder = True
    base_prefix = "bert"

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.shape = self.bert.shape
        self.num_labels = config.num_labels
        self.classifier = Linear(config.hidden_size, config.num_labels, bias=True)

    @property
    def max_model_len(self) -> int:
        return self.bert.max_model_len

    def forward(self, *args: Any) -> torch.Tensor:
        return self.bert(*args)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        assert self.bert.pooler is not None
        return self.classifier(self.bert.pooler(cls_rows)).float()


class _RobertaHead(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, bias=True)
        self.out_proj = Linear(config.hidden_size, config.num_labels, bias=True)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls_rows)))


class XLMRobertaForSequenceClassification(nn.Module):
    """logits = out_proj(tanh(dense(CLS row))): RoBERTa's classification head."""

    is_encoder = True
    base_prefix = "roberta"

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.roberta = XLMRobertaModel(config, add_pooling_layer=False)
        self.shape = self.roberta.shape
        self.num_labels = config.num_labels
        self.classifier = _RobertaHead(config)

    @property
    def max_model_len(self) -> int:
        return self.roberta.max_model_len

    def forward(self, *args: Any) -> torch.Tensor:
        return self.roberta(*args)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.classifier(cls_rows).float()
