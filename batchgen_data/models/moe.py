"""The decoder stack of mixture-of-experts models: `DecoderForCausalLM` whose MLPs are `FusedMoE`.

Where expert-level batching happens: the scheduler suspends every sequence coroutine at its next
model call, and `ModelRunner.prepare` flattens all the sequences scheduled in a step (decodes and
prompt chunks alike) into one token batch. The forward (`DecoderForCausalLM.forward`) runs that
batch layer by layer, so at each MoE layer the tokens of *every* sequence suspended at that point
of the step reach `FusedMoE.forward` together, and each expert multiplies all of its tokens in
one matmul. With `attention_micro_batch_seqs` set, the runner lays the step's attention out in
micro-batches of sequences (the attention layers attend them one after another) and the MoE still
runs once over the whole step. The scheduler's per-expert budget
(`SchedulerConfig.max_tokens_per_expert`, docs/moe.md) sizes that batch.

The architectures (Qwen3-MoE, Qwen2-MoE, Mixtral) differ only in their config names, in which
layers are sparse and in Qwen2-MoE's shared expert; each is a small subclass at the end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchgen_data.layers import parallel
from batchgen_data.layers.moe import FusedMoE
from batchgen_data.models.llama import DecoderForCausalLM, DecoderShape, LlamaMLP


@dataclass(frozen=True, slots=True)
class MoeShape:
    """The routing numbers of an MoE config (what the scheduler's per-expert budget reads)."""

    num_experts: int
    top_k: int
    intermediate: int  # each expert's width
    norm_topk_prob: bool

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} with {self.num_experts} experts: "
                             "need 1 <= num_experts_per_tok <= num_experts")


class MoeForCausalLM(DecoderForCausalLM):
    """A decoder whose sparse layers' MLP is a `FusedMoE` (the others keep a dense MLP)."""

    def __init__(self, config: Any) -> None:
        self.moe = self.moe_shape(config)  # read by make_mlp during the base constructor
        super().__init__(config)
        self.moe_layers = [layer.mlp for layer in self.layers if isinstance(layer.mlp, FusedMoE)]

    @staticmethod
    def moe_shape(config: Any) -> MoeShape:
        raise NotImplementedError

    def is_sparse(self, config: Any, layer_idx: int) -> bool:
        """Whether layer `layer_idx` routes to experts (HF's rule for Qwen2/Qwen3-MoE)."""
        step = getattr(config, "decoder_sparse_step", 1) or 1
        only_dense = getattr(config, "mlp_only_layers", None) or []
        return layer_idx not in only_dense and (layer_idx + 1) % step == 0

    def shared_expert(self, config: Any, shape: DecoderShape) -> nn.Module | None:
        return None

    def make_mlp(self, config: Any, shape: DecoderShape, layer_idx: int) -> nn.Module:
        if not self.is_sparse(config, layer_idx):
            return LlamaMLP(shape, bias=False)
        m, tp = self.moe, shape.tp
        if tp.size > 1 and tp.expert_parallel:  # whole experts per rank
            return parallel.ExpertParallelMoE(tp, shape.hidden, m.intermediate, m.num_experts,
                                              m.top_k, m.norm_topk_prob,
                                              shared_expert=self.shared_expert(config, shape))
        if tp.size > 1:  # each expert split like a dense MLP, one all-reduce per block
            return parallel.TensorParallelMoE(tp, shape.hidden, m.intermediate // tp.size,
                                              m.num_experts, m.top_k, m.norm_topk_prob,
                                              shared_expert=self.shared_expert(config, shape))
        return FusedMoE(shape.hidden, m.intermediate, m.num_experts, m.top_k, m.norm_topk_prob,
                        shared_expert=self.shared_expert(config, shape))

    def take_expert_tokens(self, on_device: bool = False) -> torch.Tensor:
        """Tokens each expert of each MoE layer received since the last call: [layers, E], in
        host memory, or left on the device (`on_device`: no wait for the device; an
        overlapped step takes its counts so, right after its launch)."""
        if not self.moe_layers:
            return torch.zeros(0, self.moe.num_experts, dtype=torch.long)
        counts = torch.stack([layer.take_expert_tokens() for layer in self.moe_layers])
        return counts if on_device else counts.cpu()


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3's attention (per-head q/k RMSNorm); `norm_topk_prob` renormalises the chosen
    weights; `decoder_sparse_step` / `mlp_only_layers` keep some layers dense."""

    qk_norm = True

    @staticmethod
    def moe_shape(config: Any) -> MoeShape:
        return MoeShape(config.num_experts, config.num_experts_per_tok,
                        config.moe_intermediate_size, bool(config.norm_topk_prob))


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2's attention (q/k/v biased, o not); routed experts plus one shared expert that every
    token passes, scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: Any) -> None:
        self.qkv_bias = bool(getattr(config, "qkv_bias", True))  # HF reads it, default on
        super().__init__(config)

    @staticmethod
    def moe_shape(config: Any) -> MoeShape:
        return MoeShape(config.num_experts, config.num_experts_per_tok,
                        config.moe_intermediate_size, bool(config.norm_topk_prob))

    def shared_expert(self, config: Any, shape: DecoderShape) -> nn.Module | None:
        width = getattr(config, "shared_expert_intermediate_size", 0)
        if not width:
            return None
        return LlamaMLP(shape, bias=False, intermediate=width // shape.tp.size, partial=True)


class MixtralForCausalLM(MoeForCausalLM):
    """Mistral's attention; every layer a mixture of `num_local_experts` experts of width
    `intermediate_size`, the top-k weights always renormalised. Checkpoints name the block
    `block_sparse_moe` and the projections w1 (gate), w3 (up), w2 (down): `moe_weights.py`."""

    @staticmethod
    def moe_shape(config: Any) -> MoeShape:
        return MoeShape(config.num_local_experts, config.num_experts_per_tok,
                        config.intermediate_size, True)

    def is_sparse(self, config: Any, layer_idx: int) -> bool:
        return True
