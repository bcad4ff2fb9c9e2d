"""GLM-4.5 / GLM-4.6 MoE (`Glm4MoeForCausalLM`), as HF's `modeling_glm4_moe.py`.

Attention is Llama's with q/k/v biased when `attention_bias` (o_proj never), an optional per-head
q/k RMSNorm (`use_qk_norm`) and a rotation of the first half of each head only
(`partial_rotary_factor`, `layers/partial_rotary.py`). Layers 0 .. first_k_dense_replace - 1
keep a dense SwiGLU MLP; every later one is a `FusedMoE` routed as DeepSeek-V3 routes (sigmoid
scores, a correction bias that steers only the choice, group-limited top-k, scaled weights:
`GroupedTopkRouter`, `models/deepseek_v3_router.py`) plus `n_shared_experts` always-on experts
summed ungated. The checkpoints' multi-token-prediction layers (numbered after the decoder's)
serve speculative decoding, which the engine does not do: skipped, as HF skips them.

Under tensor parallelism each expert is split like a dense MLP (`TensorParallelMoE`, the router
replicated); expert parallelism's router is the softmax one, so it is refused here.
"""
from __future__ import annotations

import re
from typing import Any

from torch import nn

from batchgen_data.layers import parallel
from batchgen_data.layers.moe import FusedMoE
from batchgen_data.models.deepseek_v3_router import GroupedRouting, GroupedTopkRouter
from batchgen_data.models.llama import DecoderShape, LlamaMLP
from batchgen_data.models.moe import MoeForCausalLM, MoeShape

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


class Glm4MoeForCausalLM(MoeForCausalLM):
    def __init__(self, config: Any) -> None:
        # read by the base constructor: q/k/v biased with attention_bias, o_proj never
        self.qkv_bias = bool(getattr(config, "attention_bias", False))
        self.qk_norm = bool(getattr(config, "use_qk_norm", False))
        self.routing = GroupedRouting(config.n_routed_experts, config.num_experts_per_tok,
                                      config.n_group or 1, config.topk_group or 1,
                                      bool(config.norm_topk_prob),
                                      float(config.routed_scaling_factor))
        super().__init__(config)

    @staticmethod
    def moe_shape(config: Any) -> MoeShape:
        return MoeShape(config.n_routed_experts, config.num_experts_per_tok,
                        config.moe_intermediate_size, bool(config.norm_topk_prob))

    def is_sparse(self, config: Any, layer_idx: int) -> bool:
        return layer_idx >= (config.first_k_dense_replace or 0)

    def make_mlp(self, config: Any, shape: DecoderShape, layer_idx: int) -> nn.Module:
        if not self.is_sparse(config, layer_idx):
            return LlamaMLP(shape, bias=False)
        m, tp, n_shared = self.moe, shape.tp, config.n_shared_experts or 0
        shared = (LlamaMLP(shape, bias=False, intermediate=m.intermediate * n_shared // tp.size,
                           partial=tp.size > 1) if n_shared else None)
        router = GroupedTopkRouter(shape.hidden, self.routing)
        if tp.size > 1 and tp.expert_parallel:
            raise ValueError("Glm4MoeForCausalLM under enable_expert_parallel: the expert-"
                             "parallel block routes by softmax, GLM's grouped sigmoid router "
                             "is not wired there; use tensor parallelism without it")
        if tp.size > 1:  # each expert split like a dense MLP, one all-reduce per block
            return parallel.TensorParallelMoE(tp, shape.hidden, m.intermediate // tp.size,
                                              m.num_experts, m.top_k, m.norm_topk_prob,
                                              shared_expert=shared, router=router,
                                              shared_expert_gated=False)
        return FusedMoE(shape.hidden, m.intermediate, m.num_experts, m.top_k, m.norm_topk_prob,
                        shared_expert=shared, router=router, shared_expert_gated=False)

    def skips_checkpoint_weight(self, name: str) -> bool:
        """The multi-token-prediction layers, numbered after the decoder's own."""
        m = _LAYER.match(name)
        return m is not None and int(m.group(1)) >= self.shape.num_layers
