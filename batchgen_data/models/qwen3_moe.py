"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (per-head q/k RMSNorm) with top-k softmax
routing over `num_experts` experts; `norm_topk_prob` renormalises the chosen weights;
`decoder_sparse_step` / `mlp_only_layers` keep some layers dense (width `intermediate_size`)."""
from __future__ import annotations

from typing import Any

from batchgen_data.models.moe import MoeForCausalLM, MoeShape


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True

    @staticmethod
    def moe_shape(config: Any) -> MoeShape:
        return MoeShape(config.num_experts, config.num_experts_per_tok,
                        config.moe_intermediate_size, bool(config.norm_topk_prob))
