"""Qwen2-MoE (`Qwen2MoeForCausalLM`): Qwen2's attention (q/k/v biased, o not), routed experts
plus one shared expert that every token passes, scaled by sigmoid(shared_expert_gate(x))."""
from __future__ import annotations

from typing import Any

from torch import nn

from batchgen_data.models.llama import DecoderShape, LlamaMLP
from batchgen_data.models.moe import MoeForCausalLM, MoeShape


class Qwen2MoeForCausalLM(MoeForCausalLM):
    def __init__(self, config: Any) -> None:
        # HF reads `qkv_bias` (default on); the output projection never has a bias
        self.qkv_bias = bool(getattr(config, "qkv_bias", True))
        super().__init__(config)

    @staticmethod
    def moe_shape(config: Any) -> MoeShape:
        return MoeShape(config.num_experts, config.num_experts_per_tok,
                        config.moe_intermediate_size, bool(config.norm_topk_prob))

    def shared_expert(self, config: Any, shape: DecoderShape) -> nn.Module | None:
        width = getattr(config, "shared_expert_intermediate_size", 0)
        return LlamaMLP(shape, bias=False, intermediate=width) if width else None
