"""DeepSeek-V3's router: sigmoid scores, group-limited top-k, a bias that steers only selection.

DeepSeek-V3 (arXiv 2412.19437, section 2.1.2) balances its experts without an auxiliary loss: each
expert carries a learned `e_score_correction_bias` that is added to its score when the experts are
*chosen* and ignored when their outputs are *weighted*. Selection is also limited to a few expert
groups (node-limited routing): the experts split into `n_group` equal groups, each group is ranked
by the sum of its two best biased scores, only the best `topk_group` groups stay eligible, and the
token's `top_k` experts are the best biased scores among them. The weights are the unbiased
sigmoid scores of the chosen experts, renormalised to sum 1 when `norm_topk_prob`, times
`routed_scaling_factor`. Everything runs in float32, as in HF's `DeepseekV3TopkRouter`.

`GroupedTopkRouter` plugs into `FusedMoE` as its `router` (the layer's routing hook), so the
routed experts run through the same fused kernels as the other MoE models.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class GroupedRouting:
    """The routing numbers of a DeepSeek-V3 config."""

    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    scaling: float  # routed_scaling_factor

    def __post_init__(self) -> None:
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide n_routed_experts="
                             f"{self.num_experts}")
        if self.num_experts // self.n_group < 2:
            raise ValueError(f"n_group={self.n_group}: groups are ranked by their best two "
                             f"experts, so each needs at least 2 of the {self.num_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        eligible = self.topk_group * (self.num_experts // self.n_group)
        if not 1 <= self.top_k <= eligible:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, {eligible}] (the "
                             f"experts of topk_group={self.topk_group} groups)")


def grouped_topk(logits: torch.Tensor, bias: torch.Tensor, r: GroupedRouting
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, ids [T, k] int64); see the module docstring."""
    scores = logits.float().sigmoid()  # [T, E]
    biased = scores + bias.float()  # only for choosing
    t = scores.shape[0]
    per_group = r.num_experts // r.n_group
    grouped = biased.view(t, r.n_group, per_group)
    group_rank = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    kept = group_rank.topk(r.topk_group, dim=-1).indices  # [T, topk_group]
    eligible = torch.zeros(t, r.n_group, dtype=torch.bool, device=logits.device)
    eligible.scatter_(1, kept, True)
    eligible = eligible.unsqueeze(-1).expand(t, r.n_group, per_group).reshape(t, -1)
    ids = biased.masked_fill(~eligible, float("-inf")).topk(r.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if r.norm_topk_prob:
        # HF's 1e-20 guards the all-zero case (every chosen sigmoid underflowed)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * r.scaling, ids


class GroupedTopkRouter(nn.Module):
    """`mlp.gate` of a DeepSeek-V3 MoE layer: `weight` [E, H] and `e_score_correction_bias` [E]
    (checkpoint names); x [T, H] -> (weights, ids) as `grouped_topk`."""

    def __init__(self, hidden: int, routing: GroupedRouting) -> None:
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(routing.num_experts, hidden))
        # a parameter, not a buffer, so the loader fills and checks it like any weight; it is
        # updated between training steps, never by gradients
        self.e_score_correction_bias = nn.Parameter(torch.zeros(routing.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the logits in float32 whatever the model's dtype: routing decisions are sensitive
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        return grouped_topk(logits, self.e_score_correction_bias, self.routing)

    def extra_repr(self) -> str:
        r = self.routing
        return (f"experts={r.num_experts}, top_k={r.top_k}, groups={r.n_group}, "
                f"topk_group={r.topk_group}, scaling={r.scaling}")
