"""Step-time model of a data-parallel-attention + expert-parallel MoE group, with its sources.

vLLM and SGLang serve DeepSeek-V3-class MoE models as groups of GPUs (here 16: two 8-GPU nodes)
in which every GPU is a data-parallel (DP) attention rank with its own sequences and KV, while
the routed experts are spread over all of them (EP16). Every MoE layer dispatches each rank's
tokens to the experts' GPUs and combines the results (an all-to-all), so the ranks step in
lockstep: a step ends when the slowest rank is done, and a rank with no sequence still runs a
dummy batch (vLLM `execute_dummy_batch`, SGLang's idle DP ranks) so that the collectives match.

One group step, with rank r holding b_r decoding sequences, new_r tokens to compute (decode +
prefill), kv_r KV tokens, tensor-parallel width tp (1 = DP16) and step-time factor f_r (its
slowest GPU, 1 unless a straggler), N = sum of new_r over the group:

    rank_r  = f_r * (c_fixed + c_dense / tp + c_kv * kv_r / tp + c_tok * new_r / tp + c_seq * b_r)
    experts = f_max * (t_experts * h(N) + c_moe * N / group_gpus)
    a2a     = a2a_fixed + a2a_tok * max_r(new_r) / tp
    step    = max_r(rank_r) + experts + a2a + (tp_allreduce if tp > 1)

h(N) = 1 - (1 - top_k / num_experts)^N is the share of routed experts the step's tokens touch
(each GPU streams the weights of the experts it must run). Every term is a time per step on an
H200 (4.8 TB/s HBM3e, 1979 TFLOP/s dense FP8) at 80% of peak bandwidth and 40% of peak FP8
FLOPs, FP8 weights, BF16 KV.

Sources (figures quoted, not re-measured):
* DeepEP README (github.com/deepseek-ai/DeepEP, "Low-latency kernels with pure RDMA", H800 +
  CX7 400 Gb/s, 128 tokens per rank, hidden 7168, top-8, FP8 dispatch, BF16 combine): EP16
  dispatch 118 us, combine 195 us per layer -> 313 us / 128 tokens = 2.45 us per token per
  layer; EP8 77 + 114 us. The model keeps ~30 us per layer as the latency floor.
* LMSYS, "Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96
  H100 GPUs" (lmsys.org/blog/2025-05-05-large-scale-ep): 22.3k output tokens/s per 8-GPU node
  for 2000-token inputs (2,790 tokens/s per GPU), inter-token latency ~100 ms, two-batch overlap
  worth up to ~35% in decode. The model charges half of the all-to-all (the rest overlaps).
  `anchor_tokens_per_gpu_s` evaluates the model at that point (256 sequences per rank, 2,500
  tokens of context) for comparison: see docs/benchmark-log.md.
* DeepSeek, "Day 6: DeepSeek-V3/R1 Inference System Overview" (2025-03-01): 14.8k output
  tokens/s per H800 node in decode, 20-22 tokens/s per user (with MTP), EP up to 144 GPUs.
* Model shapes from the published configs: DeepSeek-V3 61 layers (58 MoE), 256 routed experts
  top-8, hidden 7168, expert intermediate 2048, MLA KV 576 per layer (BF16: 70 KB/token), 37B
  active of 671B; Qwen3-235B-A22B 94 layers, 128 experts top-8, hidden 4096, expert intermediate
  1536, 4 KV heads x 128 (BF16: 192 KB/token), 22B active of 235B.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class EPPreset:
    name: str
    c_fixed: float  # launch + scheduling per step, per rank
    c_dense: float  # streaming the non-expert weights once (split by tp)
    c_kv: float  # per KV token read (attention)
    c_tok: float  # dense (attention projections, shared expert) FLOPs per token
    c_seq: float  # per sequence (sampling, bookkeeping)
    t_experts: float  # streaming one GPU's routed-expert weights once
    c_moe: float  # routed-expert FLOPs of one token, summed over its top-k experts
    a2a_fixed: float  # dispatch + combine latency floor over all MoE layers, per step
    a2a_tok: float  # dispatch + combine per token of the most loaded rank, per step
    tp_allreduce: float  # per step, when ranks are tensor-parallel (tp > 1)
    top_k: int
    num_experts: int
    group_gpus: int = 16
    seats_per_rank: int = 256  # DeepEP low-latency kernels: <= 256 tokens per rank
    prefill_budget: int = 8192  # prompt tokens one rank prefills per step (chunk)
    kv_bytes_per_token: int = 70_272
    link_bytes_per_s: float = 25e9  # moving a sequence's KV between ranks or groups
    reshard_s: float = 2.0  # pause to re-partition a group's ranks (communicators, graphs)
    # a re-partition's cost per GB of one GPU's non-expert weights (`dense_weight_bytes`):
    # narrowing them in place when ranks widen (up), gathering them back when they narrow
    # (down); 0 in the sourced presets, set from `benchmarks/repartition.py`'s measured rates
    # by lab/scripts/repartition_sim.py
    dense_weight_bytes: float = 0.0
    reshard_s_per_weight_gb_up: float = 0.0
    reshard_s_per_weight_gb_down: float = 0.0
    reshard_kv_bytes_per_s: float | None = None  # re-laying the KV; None: `link_bytes_per_s`
    source: str = ""
    layers: int = 0  # decoder layers (the per-layer collectives of a TP step)
    collective_s: float = 10e-6  # one small all-reduce over NVLink (sourced), in tp_allreduce

    def reshard_pause(self, old_tp: int, new_tp: int, kv_tokens: float) -> float:
        """Seconds a group pauses to go from ranks `old_tp` wide to `new_tp` wide, its busiest
        new rank receiving `kv_tokens` tokens of KV."""
        per_gb = (self.reshard_s_per_weight_gb_up if new_tp > old_tp
                  else self.reshard_s_per_weight_gb_down)
        weights = per_gb * self.dense_weight_bytes / 1e9
        rate = self.reshard_kv_bytes_per_s or self.link_bytes_per_s
        return self.reshard_s + weights + kv_tokens * self.kv_bytes_per_token / rate

    def expert_share(self, n_tokens: float) -> float:
        """Share of the routed experts that n tokens (top-k each) touch, in expectation."""
        return 1.0 - (1.0 - self.top_k / self.num_experts) ** n_tokens

    def rank_times(self, b: np.ndarray, new: np.ndarray, kv: np.ndarray, f: np.ndarray,
                   tp: int) -> np.ndarray:
        """[ranks] each rank's own (attention + dense) time for one step."""
        return f * (self.c_fixed + (self.c_dense + self.c_kv * kv + self.c_tok * new) / tp
                    + self.c_seq * b)

    def shared_time(self, n_tokens: float, max_new: float, f_max: float, tp: int) -> float:
        """Time every rank waits for together: the experts, the all-to-all, the TP reduce."""
        experts = f_max * (self.t_experts * self.expert_share(n_tokens)
                           + self.c_moe * n_tokens / self.group_gpus)
        a2a = self.a2a_fixed + self.a2a_tok * max_new / tp
        return experts + a2a + (self.tp_allreduce if tp > 1 else 0.0)

    def step_time(self, b: np.ndarray, new: np.ndarray, kv: np.ndarray, f: np.ndarray,
                  tp: int = 1) -> float:
        n = float(new.sum())
        return float(self.rank_times(b, new, kv, f, tp).max()) + self.shared_time(
            n, float(new.max()), float(f.max()), tp)

    def anchor_tokens_per_gpu_s(self, seqs: int = 256, context: int = 2500) -> float:
        """Decode throughput per GPU with every rank full (the LMSYS comparison point)."""
        r = self.group_gpus
        b = np.full(r, seqs, dtype=np.float64)
        t = self.step_time(b, b, b * context, np.ones(r))
        return seqs / t


_BW = 4.8e12 * 0.8  # H200 HBM3e at 80% of peak
_FLOPS = 1979e12 * 0.4  # H200 dense FP8 at 40% of peak

EP_PRESETS: dict[str, EPPreset] = {
    # DeepSeek-V3 (671B, FP8): non-expert weights ~15 GB per GPU, routed experts 656B / 16 GPUs
    # = 41 GB per GPU; 16.6B dense-active and 20.4B routed-active parameters per token
    "ep-moe-dsv3": EPPreset(
        "ep-moe-dsv3", c_fixed=1.0e-3, c_dense=15e9 / _BW, c_kv=70_272 / _BW,
        c_tok=2 * 16.6e9 / _FLOPS, c_seq=5e-6, t_experts=41e9 / _BW, c_moe=2 * 20.4e9 / _FLOPS,
        a2a_fixed=0.5 * 58 * 30e-6, a2a_tok=0.5 * 58 * 313e-6 / 128,
        tp_allreduce=61 * 2 * 10e-6, top_k=8, num_experts=256, kv_bytes_per_token=70_272,
        dense_weight_bytes=15e9, layers=61, source="DeepSeek-V3 FP8 on 16 H200 per group; DeepEP README, LMSYS large-scale EP blog"),
    # Qwen3-235B-A22B (FP8): non-expert ~8 GB, routed 227B / 16 = 14.2 GB per GPU; 8B dense-
    # and 14.2B routed-active; hidden 4096 = 0.57x DeepSeek's, so 0.57x the all-to-all bytes
    "qwen3-235b": EPPreset(
        "qwen3-235b", c_fixed=1.0e-3, c_dense=8e9 / _BW, c_kv=192_512 / _BW,
        c_tok=2 * 8e9 / _FLOPS, c_seq=5e-6, t_experts=14.2e9 / _BW, c_moe=2 * 14.2e9 / _FLOPS,
        a2a_fixed=0.5 * 94 * 30e-6, a2a_tok=0.5 * 94 * 0.57 * 313e-6 / 128,
        tp_allreduce=94 * 2 * 10e-6, top_k=8, num_experts=128, kv_bytes_per_token=192_512,
        dense_weight_bytes=8e9, layers=94, source="Qwen3-235B-A22B FP8 on 16 H200 per group; DeepEP README scaled by hidden size"),
}
