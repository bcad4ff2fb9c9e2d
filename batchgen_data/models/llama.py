"""Llama-family decoder stacks: Llama, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

Mirrors HF's `modeling_llama.py`, with the projections fused (q|k|v and gate|up, filled shard by
shard by the loader) so each layer runs four matmuls. The model takes a flattened batch of new
tokens and the paged KV cache and returns hidden states; logits are computed only at the
positions that are sampled. Which kernels the layers run is decided when they are built
(`batchgen_data.layers.backend`), never here.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchgen_data.layers.activation import SiluAndMul
from batchgen_data.layers.attention import Attention, AttentionMetadata
from batchgen_data.layers.embedding import VocabEmbedding
from batchgen_data.layers.linear import Linear, MergedLinear, QKVLinear
from batchgen_data.layers.norm import RMSNorm
from batchgen_data.layers import long_rope, parallel, partial_rotary
from batchgen_data.layers.partial_rotary import PartialRotaryEmbedding
from batchgen_data.layers.rotary import RotaryEmbedding, rope_parameters

def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: global attention), read as HF reads it: a config's
    `layer_types` marks its windowed layers ("sliding_attention": Gemma, Qwen2/3 past
    `max_window_layers`, gpt-oss), else a set `sliding_window` windows every layer (Mistral,
    Mixtral, Qwen3-MoE); `use_sliding_window=False` or no window size: none."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [None] * n
    types = getattr(config, "layer_types", None)
    if types:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        return [int(window) if t == "sliding_attention" else None for t in types]
    return [int(window)] * n


class DecoderShape:
    """The numbers the engine needs from an HF config."""

    tp = parallel.SINGLE  # (a subclass that fills its own numbers is never sharded)

    def __init__(self, config: Any) -> None:
        self.hidden = config.hidden_size
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.num_heads
        self.intermediate = config.intermediate_size
        self.vocab = config.vocab_size
        self.eps = config.rms_norm_eps
        # LongRoPE: the engine's max_model_len picks the factors and the table's length
        self.max_positions = long_rope.served_positions(rope_parameters(config), config)
        self.rotary_dim = partial_rotary.rotary_dim(config, self.head_dim)
        self.windows = layer_windows(config)  # per layer: its sliding window, None for global
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        # built as one rank's shard (layers/parallel.py): its heads and MLP width; the model's
        # totals stay in total_heads / total_kv_heads, the vocabulary is always the whole one
        self.tp = tp = parallel.current()
        self.total_heads, self.total_kv_heads = self.num_heads, self.num_kv_heads
        if tp.size > 1:
            parallel.check_shape(config, tp.size)
            self.num_heads //= tp.size
            self.num_kv_heads = parallel.local_kv_heads(self.num_kv_heads, tp.size)
            self.intermediate //= tp.size


class LlamaAttention(nn.Module):
    def __init__(self, shape: DecoderShape, rotary: RotaryEmbedding, qkv_bias: bool,
                 o_bias: bool, qk_norm: bool, layer_idx: int) -> None:
        super().__init__()
        s = shape
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.tp = s.tp
        self.qkv_proj = QKVLinear(s.hidden, s.head_dim, s.num_heads, s.num_kv_heads, qkv_bias)
        self.o_proj = Linear(s.num_heads * s.head_dim, s.hidden, bias=o_bias)
        self.q_norm = RMSNorm(s.head_dim, s.eps) if qk_norm else None
        self.k_norm = RMSNorm(s.head_dim, s.eps) if qk_norm else None
        self.rotary_emb = rotary
        self.attn = Attention(s.num_heads, s.num_kv_heads, s.head_dim, s.head_dim ** -0.5,
                              layer_idx, sliding_window=s.windows[layer_idx])

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.shard_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, kv_cache, meta)  # [T, H, D]
        return self.tp.all_reduce(self.o_proj(o.flatten(1)))  # row-parallel: one sum


class LlamaMLP(nn.Module):
    def __init__(self, shape: DecoderShape, bias: bool, intermediate: int | None = None,
                 partial: bool = False) -> None:
        """`partial`: under tensor parallelism leave the sum over ranks to the block holding
        this MLP (an MoE's shared expert, `layers/parallel.TensorParallelMoE`)."""
        super().__init__()
        width = intermediate or shape.intermediate
        self.gate_up_proj = MergedLinear(shape.hidden, [width] * 2, bias=bias)
        self.down_proj = Linear(width, shape.hidden, bias=bias)
        self.act_fn = SiluAndMul()
        self.tp = parallel.SINGLE if partial else shape.tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.act_fn(self.gate_up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    """Attention then `mlp`: a dense MLP (`LlamaMLP`) or a mixture of experts (`FusedMoE`)."""

    def __init__(self, shape: DecoderShape, rotary: RotaryEmbedding, qkv_bias: bool,
                 o_bias: bool, qk_norm: bool, mlp: nn.Module, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden, shape.eps)
        self.self_attn = LlamaAttention(shape, rotary, qkv_bias, o_bias, qk_norm, layer_idx)
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderForCausalLM(nn.Module):
    """The decoder stack shared by the dense models and the MoE ones (`models/moe.py`): each
    layer's MLP comes from `make_mlp`."""

    qkv_bias = False
    qk_norm = False

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.shape = s = DecoderShape(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = self.qkv_bias or attention_bias
        o_bias = attention_bias and not self.qkv_bias  # Qwen2: q/k/v biased, o never
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.rotary = (RotaryEmbedding(config, s.head_dim, s.max_positions)
                       if s.rotary_dim == s.head_dim else
                       PartialRotaryEmbedding(config, s.head_dim, s.rotary_dim, s.max_positions))
        tp, tied = s.tp, self.tie_word_embeddings
        self.embed_tokens = (VocabEmbedding(s.vocab, s.hidden, tied_head=tied) if tp.size == 1
                             else parallel.VocabParallelEmbedding(s.vocab, s.hidden, tp, tied))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(s, self.rotary, qkv_bias, o_bias, self.qk_norm,
                              self.make_mlp(config, s, i), i)
            for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden, s.eps)
        head_rows = parallel.padded_vocab(s.vocab, tp.size) // tp.size
        self.lm_head = None if self.tie_word_embeddings else Linear(s.hidden, head_rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's new tokens, each layer attending over its
        cache of `kv_caches` as `attn_metadata` lays the step out."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv_cache, attn_metadata)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        if self.lm_head is None:
            local = self.embed_tokens.as_head(hidden)
        else:
            local = self.lm_head(hidden)
        return self.shape.tp.gather_vocab(local, self.shape.vocab).float()

    def make_mlp(self, config: Any, shape: DecoderShape, layer_idx: int) -> nn.Module:
        return LlamaMLP(shape, bias=bool(getattr(config, "mlp_bias", False)))


class LlamaForCausalLM(DecoderForCausalLM):
    """Also serves Qwen2 (`qkv_bias=True`) and Qwen3 (`qk_norm=True`)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
