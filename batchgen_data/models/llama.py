"""Llama-family decoder stacks: Llama, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

Projections are fused at load time (q|k|v and gate|up) so each layer runs four matmuls. The
model takes a flattened batch of new tokens and the paged KV cache and returns hidden states;
logits are computed only at the positions that are sampled.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchgen_data.layers import backend, cpu_ops
from batchgen_data.layers.attention import AttentionMetadata, attention
from batchgen_data.layers.cpu_linear import packed_linear
from batchgen_data.layers.norm import RMSNorm
from batchgen_data.layers.rotary import RotaryEmbedding


class DecoderShape:
    """The numbers the engine needs from an HF config."""

    def __init__(self, config: Any) -> None:
        self.hidden = config.hidden_size
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.num_heads
        self.intermediate = config.intermediate_size
        self.vocab = config.vocab_size
        self.eps = config.rms_norm_eps
        self.max_positions = config.max_position_embeddings
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")


class Attention(nn.Module):
    def __init__(self, config: Any, shape: DecoderShape, rotary: RotaryEmbedding,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.shape = shape
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.qkv_proj = nn.Linear(shape.hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, shape.hidden, bias=o_bias)
        self.q_norm = RMSNorm(shape.head_dim, shape.eps) if qk_norm else None
        self.k_norm = RMSNorm(shape.head_dim, shape.eps) if qk_norm else None
        self.rotary = rotary
        self.scale = shape.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        s = self.shape
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        # fp32 on the CPU: q and k heads are adjacent in qkv; rotate them in place, in C
        rotated = (self.q_norm is None and cpu_ops.usable(qkv)
                   and self.rotary.cos_sin_cache.dtype == torch.float32)
        if rotated:
            cpu_ops.rotate_(qkv, s.num_heads + s.num_kv_heads, s.head_dim, positions,
                            self.rotary.cos_sin_cache)
        if self.q_norm is None and not rotated and not backend.use_triton(qkv):
            # torch path: q and k heads are adjacent in qkv, so one rotation covers both
            qk = qkv[:, :self.q_size + self.kv_size].view(-1, s.num_heads + s.num_kv_heads, s.head_dim)
            q, k = self.rotary.rotate(positions, qk).split([s.num_heads, s.num_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size:].view(-1, s.num_kv_heads, s.head_dim)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(-1, s.num_heads, s.head_dim)
            k = k.view(-1, s.num_kv_heads, s.head_dim)
            v = v.view(-1, s.num_kv_heads, s.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if not rotated:
                q, k = self.rotary(positions, q, k)
        o = attention(q, k, v, kv[0], kv[1], meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, shape: DecoderShape, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(shape.hidden, 2 * shape.intermediate, bias=bias)
        self.down_proj = nn.Linear(shape.intermediate, shape.hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)  # [T, 2I]
        if backend.use_triton(gu):
            from batchgen_data.kernels import silu_and_mul
            return self.down_proj(silu_and_mul(gu))
        if cpu_ops.usable(gu):  # fp32 CPU: one C pass instead of chunk + silu + mul
            return self.down_proj(cpu_ops.silu_mul(gu))
        gate, up = gu.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, shape: DecoderShape, rotary: RotaryEmbedding,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden, shape.eps)
        self.self_attn = Attention(config, shape, rotary, qkv_bias, o_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.eps)
        self.mlp = MLP(shape, bias=bool(getattr(config, "mlp_bias", False)))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, kv, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Also serves Qwen2 (`qkv_bias=True`) and Qwen3 (`qk_norm=True`)."""

    qkv_bias = False
    qk_norm = False

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.shape = s = DecoderShape(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = self.qkv_bias or attention_bias
        o_bias = attention_bias and not self.qkv_bias  # Qwen2: q/k/v biased, o never
        self.rotary = RotaryEmbedding(config, s.head_dim, s.max_positions)
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(
            DecoderLayer(config, s, self.rotary, qkv_bias, o_bias, self.qk_norm) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden, s.eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
                ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden).float()  # [N, vocab]
        packed = getattr(self, "packed_lm_head", None)  # tied weights, packed for the CPU
        if packed is not None:
            return packed_linear(hidden, packed, None, self.embed_tokens.weight,
                                 getattr(self, "lm_head_small_gemm", False),
                                 getattr(self, "panel_lm_head", None)).float()
        return F.linear(hidden, self.embed_tokens.weight).float()


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
