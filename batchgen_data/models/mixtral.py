"""Mixtral (`MixtralForCausalLM`): Mistral's attention, every layer a mixture of
`num_local_experts` experts of width `intermediate_size`, top-k weights always renormalised.
Checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate), w3 (up)
and w2 (down); `models/moe_weights.py` maps them."""
from __future__ import annotations

from typing import Any

from batchgen_data.models.moe import MoeForCausalLM, MoeShape


class MixtralForCausalLM(MoeForCausalLM):
    @staticmethod
    def moe_shape(config: Any) -> MoeShape:
        return MoeShape(config.num_local_experts, config.num_experts_per_tok,
                        config.intermediate_size, True)

    def is_sparse(self, config: Any, layer_idx: int) -> bool:
        return True
