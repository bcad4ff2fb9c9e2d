"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): MLA attention and a mixture of experts with grouped,
bias-corrected sigmoid routing plus always-on shared experts. Mirrors HF's `modeling_deepseek_v3`.

Layers 0 .. first_k_dense_replace - 1 keep a dense SwiGLU MLP (`intermediate_size`); every later
layer is a `FusedMoE` whose router is `GroupedTopkRouter` (`deepseek_v3_router.py`) and whose
shared expert is one SwiGLU MLP of width `moe_intermediate_size * n_shared_experts`, added to
the routed experts' output without a gate. Attention is `MultiHeadLatentAttention`
(`layers/mla.py`), which caches the compressed latent rather than per-head keys and values: the
model's `shape` therefore reports one KV head of width kv_lora_rank + qk_rope_head_dim, and
the engine sizes its paged cache from that.

The decoder loop and the one-pass MoE per step are `MoeForCausalLM`'s (see `models/moe.py` for
where expert-level batching happens). The multi-token
prediction layers of the released checkpoints (`model.layers.{num_hidden_layers}...`) are for
speculative decoding, which the engine does not do: their weights are skipped, as HF does.
"""
from __future__ import annotations

import re
from typing import Any

from torch import nn

from batchgen_data.layers.embedding import VocabEmbedding
from batchgen_data.layers.linear import Linear
from batchgen_data.layers.mla import MlaShape, MultiHeadLatentAttention
from batchgen_data.layers.moe import FusedMoE
from batchgen_data.layers.norm import RMSNorm
from batchgen_data.layers.rotary import RotaryEmbedding
from batchgen_data.models.deepseek_v3_rope import deepseek_rope
from batchgen_data.models.deepseek_v3_router import GroupedRouting, GroupedTopkRouter
from batchgen_data.models.llama import DecoderShape, LlamaDecoderLayer, LlamaMLP
from batchgen_data.models.moe import MoeForCausalLM, MoeShape

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


class DeepseekV3Shape(DecoderShape):
    """`DecoderShape` whose KV numbers describe MLA's cache: one latent head per token. Filled
    here rather than by the base, which would read and check `num_key_value_heads`, a number
    MLA has no use for (DeepSeek-V3's config defaults it to 128 whatever the head count)."""

    def __init__(self, config: Any) -> None:
        self.mla = MlaShape(config)
        self.hidden = config.hidden_size
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = 1
        self.head_dim = self.mla.cache_head_dim
        self.kv_planes = 1  # the latent rows are the keys and the values (core/kv/planes.py)
        self.intermediate = config.intermediate_size
        self.vocab = config.vocab_size
        self.eps = config.rms_norm_eps
        self.max_positions = config.max_position_embeddings


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    """`LlamaDecoderLayer`'s residual flow (`forward`) around MLA attention."""

    def __init__(self, shape: DeepseekV3Shape, rotary: RotaryEmbedding, scale: float,
                 mlp: nn.Module, layer_idx: int) -> None:
        nn.Module.__init__(self)  # the base would build a Llama attention, replaced here
        self.input_layernorm = RMSNorm(shape.hidden, shape.eps)
        self.self_attn = MultiHeadLatentAttention(shape.mla, rotary, scale, layer_idx)
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.eps)
        self.mlp = mlp


class DeepseekV3ForCausalLM(MoeForCausalLM):
    def __init__(self, config: Any) -> None:
        # built here rather than by DecoderForCausalLM.__init__, whose layers carry Llama
        # attention; the attributes are the ones the inherited forward and engine read
        nn.Module.__init__(self)
        self.config = config
        self.routing = self.grouped_routing(config)
        self.moe = self.moe_shape(config)
        self.shape = s = DeepseekV3Shape(config)
        rope_config, scale = deepseek_rope(config)  # yarn's DeepSeek variant: deepseek_v3_rope
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.rotary = RotaryEmbedding(rope_config, s.mla.rope, s.max_positions)
        self.embed_tokens = VocabEmbedding(s.vocab, s.hidden, tied_head=self.tie_word_embeddings)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(s, self.rotary, scale, self.make_mlp(config, s, i), i)
            for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden, s.eps)
        self.lm_head = None if self.tie_word_embeddings else Linear(s.hidden, s.vocab)
        self.moe_layers = [layer.mlp for layer in self.layers if isinstance(layer.mlp, FusedMoE)]

    @staticmethod
    def grouped_routing(config: Any) -> GroupedRouting:
        return GroupedRouting(config.n_routed_experts, config.num_experts_per_tok,
                              config.n_group or 1, config.topk_group or 1,
                              bool(config.norm_topk_prob), float(config.routed_scaling_factor))

    @staticmethod
    def moe_shape(config: Any) -> MoeShape:
        return MoeShape(config.n_routed_experts, config.num_experts_per_tok,
                        config.moe_intermediate_size, bool(config.norm_topk_prob))

    def is_sparse(self, config: Any, layer_idx: int) -> bool:
        return layer_idx >= (config.first_k_dense_replace or 0)

    def make_mlp(self, config: Any, shape: DecoderShape, layer_idx: int) -> nn.Module:
        if not self.is_sparse(config, layer_idx):
            return LlamaMLP(shape, bias=False)
        m, shared = self.moe, config.n_shared_experts or 0
        return FusedMoE(shape.hidden, m.intermediate, m.num_experts, m.top_k, m.norm_topk_prob,
                        shared_expert=(LlamaMLP(shape, bias=False,
                                                intermediate=m.intermediate * shared)
                                       if shared else None),
                        router=GroupedTopkRouter(shape.hidden, self.routing),
                        shared_expert_gated=False)

    def skips_checkpoint_weight(self, name: str) -> bool:
        """The multi-token-prediction layers, numbered after the decoder's own."""
        m = _LAYER.match(name)
        return m is not None and int(m.group(1)) >= self.shape.num_layers
