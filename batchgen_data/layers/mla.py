"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged KV cache, caching the latent.

What a DeepSeek-V3 layer computes (HF `DeepseekV3Attention`, arXiv 2405.04434 section 2.1):
  q        = q_b_proj(norm(q_a_proj(x)))  (or q_proj(x) without `q_lora_rank`)  [T, H, n + r]
  c, k_r   = kv_a_proj_with_mqa(x) split into the latent [T, L] and one shared rope key [T, r]
  c        = kv_a_layernorm(c)
  k_n, v   = kv_b_proj(c) per head: [T, H, n] and [T, H, v]
  k        = [k_n | rope(k_r) for every head],  q = [q_n | rope(q_r)]
  out      = o_proj(softmax(q k^T * scale) v),  scale = (n + r) ** -0.5 (x yarn's mscale^2)
with n = qk_nope_head_dim, r = qk_rope_head_dim, L = kv_lora_rank.

**What the cache holds.** Not the expanded per-head K and V (H * (n + r) + H * v numbers per
token and layer: 40,960 for DeepSeek-V3) but the latent and the rope key, L + r numbers, as one
KV "head" shared by all query heads. That works because kv_b_proj is linear, so its two halves
W_uk [H, n, L] and W_uv [H, v, L] can be moved to the query and the output ("absorbed"):
  q_n . (W_uk c) = (W_uk^T q_n) . c      and      sum_s p_s W_uv c_s = W_uv (sum_s p_s c_s).
Each head's query becomes [W_uk^T q_n | rope(q_r)] (L + r wide) against keys [c | rope(k_r)], and
the attention output over the same rows, cut to its first L columns, is sum_s p_s c_s, which W_uv
maps to the head's value. The cache has one plane for this layer's model (`kv_planes = 1`,
core/kv/planes.py): the attention's V is the K plane itself (the layer reads only its first L
columns back). For DeepSeek-V3 that is 576 numbers per token and layer instead of 40,960: about
71x less KV memory, so 71x more sequences' context fits.
The price is compute: every query head attends over L + r = 576 dims instead of n + r = 192, which
is the trade DeepSeek's own decode kernels make (attention is memory-bound in decode).

The attention itself is the engine's `Attention` (paged, chunked prefill, prefix hits, export and
import of KV blocks all work unchanged): MQA with one KV head of width L + r.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchgen_data.layers.attention import Attention, AttentionMetadata
from batchgen_data.layers.linear import Linear
from batchgen_data.layers.norm import RMSNorm
from batchgen_data.layers.rotary import RotaryEmbedding

# HF builds q_a_layernorm / kv_a_layernorm with the RMSNorm default, not the config's rms_norm_eps
_LATENT_NORM_EPS = 1e-6


class MlaShape:
    """The MLA numbers of a DeepSeek-V2/V3 config."""

    def __init__(self, config: Any) -> None:
        self.hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_lora_rank: int | None = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope = config.qk_nope_head_dim
        self.rope = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.bias = bool(getattr(config, "attention_bias", False))
        # DeepSeek's checkpoints store each rope pair as adjacent dims (x0, x1), (x2, x3), ...
        self.rope_interleave = bool(getattr(config, "rope_interleave", True))
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not getattr(config, name) or getattr(config, name) < 1:
                raise ValueError(f"{name}={getattr(config, name)!r}: MLA needs a positive width")
        if self.rope % 2:
            raise ValueError(f"qk_rope_head_dim={self.rope} must be even (rope rotates pairs)")

    @property
    def qk_head_dim(self) -> int:
        return self.nope + self.rope

    @property
    def cache_head_dim(self) -> int:
        """Width of the one cached KV head: the latent and the rope key."""
        return self.kv_lora_rank + self.rope


class KvUpProjection(nn.Module):
    """`kv_b_proj`: the [H * (n + v), L] weight as stored, never repacked, because MLA splits it
    per head into W_uk and W_uv and multiplies the query and the output by them instead."""

    def __init__(self, latent: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, latent))


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, s: MlaShape, rotary: RotaryEmbedding, scale: float, layer_idx: int
                 ) -> None:
        super().__init__()
        self.s = s
        h, qk = s.num_heads, s.qk_head_dim
        if s.q_lora_rank is None:
            self.q_proj = Linear(s.hidden, h * qk)
        else:
            self.q_a_proj = Linear(s.hidden, s.q_lora_rank, bias=s.bias)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = Linear(s.q_lora_rank, h * qk)
        self.kv_a_proj_with_mqa = Linear(s.hidden, s.kv_lora_rank + s.rope, bias=s.bias)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = KvUpProjection(s.kv_lora_rank, h * (s.nope + s.v_head_dim))
        self.o_proj = Linear(h * s.v_head_dim, s.hidden, bias=s.bias)
        self.rotary_emb = rotary
        self.attn = Attention(h, 1, s.cache_head_dim, scale, layer_idx)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        s, t = self.s, x.shape[0]
        if s.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(t, s.num_heads, s.qk_head_dim).split([s.nope, s.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())  # [T, L]
        q_rot, k_rot = self.rotary_emb(positions, self._rope_layout(q_rot),
                                       self._rope_layout(k_rot.view(t, 1, s.rope)))
        w = self.kv_b_proj.weight.view(s.num_heads, s.nope + s.v_head_dim, s.kv_lora_rank)
        w_uk, w_uv = w[:, :s.nope], w[:, s.nope:]  # [H, n, L], [H, v, L]
        # per head: W_uk^T q_n, [H, T, n] @ [H, n, L] -> [H, T, L]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
        query = torch.cat([q_latent, q_rot], dim=-1)  # [T, H, L + r]
        key = torch.cat([latent.unsqueeze(1), k_rot], dim=-1)  # [T, 1, L + r]
        # the value rows are the key rows: only their latent part (the first L columns) is used
        o = self.attn(query, key, key, kv_cache, meta)[..., :s.kv_lora_rank]  # [T, H, L]
        # per head: W_uv (sum_s p_s c_s), [H, T, L] @ [H, L, v] -> [H, T, v]
        values = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return self.o_proj(values.reshape(t, s.num_heads * s.v_head_dim))

    def _rope_layout(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, r] in the "rotate half" layout our rotary embedding uses, contiguous (the
        C rotation works in place). Interleaved pairs become [evens | odds]: the rotation HF
        applies to interleaved weights is exactly rotate-half on that permutation, and q and k
        being permuted alike leaves q . k unchanged."""
        if self.s.rope_interleave:
            return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return x.contiguous()
