"""Gemma 2 and Gemma 3 (text) decoders.

Mirrors HF's `modeling_gemma2.py` / `modeling_gemma3.py` with the projections fused as in
`models/llama.py`: RMSNorms that scale by (1 + weight) around both the attention and the MLP
(pre- and post-norms; checkpoints store the offset from one, which `stored_form` adds when
the loader copies it in, so the C and Triton norms run unchanged and a re-partition copies
the scale as it is), a GeGLU MLP (GELU, tanh approximation), queries scaled by
`query_pre_attn_scalar` ** -0.5 instead of head_dim ** -0.5, the embedding scaled by
sqrt(hidden), local (sliding-window) and global layers as `layer_types` says. Gemma 2 adds
logit soft-capping, in attention (the kernels' `softcap`) and on the final logits; Gemma 3
adds per-head q/k RMSNorms and a RoPE per layer type (a local base for windowed layers, a
global base and scaling for the others).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchgen_data.layers.activation import GeluTanhAndMul
from batchgen_data.layers.attention import Attention, AttentionMetadata
from batchgen_data.layers.embedding import VocabEmbedding
from batchgen_data.layers.linear import Linear
from batchgen_data.layers.norm import RMSNorm
from batchgen_data.layers import parallel
from batchgen_data.layers.rotary import RotaryEmbedding
from batchgen_data.models.llama import DecoderShape, LlamaAttention, LlamaMLP


class _RopeOf:
    """The config as one layer type's rotary embedding reads it: Gemma 3 keeps a
    `rope_parameters` dict per layer type."""

    def __init__(self, config: Any, params: dict[str, Any]) -> None:
        self._config = config
        self.rope_parameters = params
        self.rope_scaling = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _rotaries(config: Any, shape: DecoderShape) -> dict[str, RotaryEmbedding]:
    """One rotary embedding per layer type (one shared by all when the config has one)."""
    params = getattr(config, "rope_parameters", None) or {}
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if all(isinstance(params.get(t), dict) for t in types):
        return {t: RotaryEmbedding(_RopeOf(config, dict(params[t])), shape.head_dim,
                                   shape.max_positions) for t in sorted(types)}
    one = RotaryEmbedding(config, shape.head_dim, shape.max_positions)
    return {t: one for t in types}


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's query scale, its window and soft-cap, and (Gemma 3) q/k
    norms."""

    def __init__(self, shape: DecoderShape, config: Any, rotary: RotaryEmbedding,
                 qk_norm: bool, layer_idx: int) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(shape, rotary, bias, bias, False, layer_idx)
        s = shape
        if qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.eps)
            self.k_norm = RMSNorm(s.head_dim, s.eps)
        scale = float(getattr(config, "query_pre_attn_scalar", None) or s.head_dim) ** -0.5
        self.attn = Attention(s.num_heads, s.num_kv_heads, s.head_dim, scale, layer_idx,
                              sliding_window=s.windows[layer_idx],
                              softcap=getattr(config, "attn_logit_softcapping", None))


class GemmaDecoderLayer(nn.Module):
    """norm -> attention -> norm, added; norm -> GeGLU MLP -> norm, added."""

    def __init__(self, shape: DecoderShape, config: Any, rotary: RotaryEmbedding,
                 qk_norm: bool, layer_idx: int) -> None:
        super().__init__()
        h, eps = shape.hidden, shape.eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = GemmaAttention(shape, config, rotary, qk_norm, layer_idx)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = LlamaMLP(shape, bias=False)
        self.mlp.act_fn = GeluTanhAndMul()
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2ForCausalLM(nn.Module):
    """Gemma 2; `Gemma3ForCausalLM` (text) sets `qk_norm`. The interface is the Llama
    family's (`models/llama.DecoderForCausalLM`): forward to hidden states, compute_logits."""

    qk_norm = False

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.shape = s = DecoderShape(config)
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (an embedding Gemma) is not "
                             "supported for generation")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.rotaries = nn.ModuleDict(_rotaries(config, s))
        tp, tied = s.tp, self.tie_word_embeddings
        self.embed_tokens = (VocabEmbedding(s.vocab, s.hidden, tied_head=tied) if tp.size == 1
                             else parallel.VocabParallelEmbedding(s.vocab, s.hidden, tp, tied))
        types = getattr(config, "layer_types", None) or ["full_attention"] * s.num_layers
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(s, config, self.rotaries[types[i]], self.qk_norm, i)
            for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden, s.eps)
        head_rows = parallel.padded_vocab(s.vocab, tp.size) // tp.size
        self.lm_head = None if tied else Linear(s.hidden, head_rows)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    @staticmethod
    def stored_form(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as this model keeps it: a norm's weight is HF's offset from one,
        kept as the scale itself (1 + weight, in float32 as HF computes it)."""
        if name.endswith("norm.weight"):
            return tensor.float() + 1.0
        return tensor

    @property
    def rotary(self) -> RotaryEmbedding:
        """The global layers' rotary embedding (what a reader of one model-wide table gets)."""
        if "full_attention" in self.rotaries:
            return self.rotaries["full_attention"]
        return next(iter(self.rotaries.values()))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's new tokens."""
        x = self.embed_tokens(input_ids)
        # HF rounds sqrt(hidden) to the model's dtype before scaling
        x = x * torch.tensor(self.shape.hidden ** 0.5, dtype=x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv_cache, attn_metadata)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, soft-capped where the config says."""
        local = self.embed_tokens.as_head(hidden) if self.lm_head is None else self.lm_head(hidden)
        logits = self.shape.tp.gather_vocab(local, self.shape.vocab).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
