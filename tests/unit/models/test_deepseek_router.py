"""DeepSeek-V3's grouped routing equals a per-token reference written from the paper's rule and
HF's router; groups are excluded as a whole; the correction bias moves the choice, not the
weights; configs that cannot route are refused by name."""
from __future__ import annotations

import pytest
import torch

from batchgen_data.models.deepseek_v3_router import (GroupedRouting, GroupedTopkRouter,
                                                     grouped_topk)


def naive_route(logits: torch.Tensor, bias: torch.Tensor, r: GroupedRouting
                ) -> list[dict[int, float]]:
    """Token by token, in plain Python: {expert: weight} of each token's chosen experts."""
    per = r.num_experts // r.n_group
    out = []
    for row in logits.tolist():
        scores = [1 / (1 + torch.exp(torch.tensor(-v)).item()) for v in row]
        biased = [s + float(b) for s, b in zip(scores, bias)]
        group_rank = [sum(sorted(biased[g * per:(g + 1) * per], reverse=True)[:2])
                      for g in range(r.n_group)]
        kept = sorted(range(r.n_group), key=lambda g: -group_rank[g])[:r.topk_group]
        eligible = [e for g in kept for e in range(g * per, (g + 1) * per)]
        chosen = sorted(eligible, key=lambda e: -biased[e])[:r.top_k]
        total = sum(scores[e] for e in chosen) if r.norm_topk_prob else 1.0
        out.append({e: scores[e] / total * r.scaling for e in chosen})
    return out


def as_dicts(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i, w)) for i, w in zip(ids.tolist(), weights.tolist())]


@pytest.mark.parametrize("r", [
    GroupedRouting(16, 3, n_group=4, topk_group=2, norm_topk_prob=True, scaling=2.5),
    GroupedRouting(12, 4, n_group=3, topk_group=3, norm_topk_prob=False, scaling=1.0),
    GroupedRouting(8, 2, n_group=1, topk_group=1, norm_topk_prob=True, scaling=1.0),
    GroupedRouting(32, 8, n_group=8, topk_group=2, norm_topk_prob=True, scaling=2.5),
])
def test_matches_the_per_token_reference(r: GroupedRouting) -> None:
    gen = torch.Generator().manual_seed(r.num_experts + r.top_k)
    # continuous random scores: no ties between experts or groups
    logits = torch.randn(40, r.num_experts, generator=gen) * 3
    bias = torch.randn(r.num_experts, generator=gen) * 0.3
    weights, ids = grouped_topk(logits, bias, r)
    assert weights.dtype == torch.float32 and ids.shape == (40, r.top_k)
    got, want = as_dicts(weights, ids), naive_route(logits, bias, r)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for e in w:
            assert g[e] == pytest.approx(w[e], rel=1e-5)
    if r.topk_group < r.n_group:  # every chosen expert lies in one of the kept groups
        per = r.num_experts // r.n_group
        assert all(len({e // per for e in row}) <= r.topk_group for row in ids.tolist())


def test_a_group_with_one_strong_expert_is_excluded() -> None:
    r = GroupedRouting(8, 2, n_group=4, topk_group=2, norm_topk_prob=True, scaling=1.0)
    # expert 0 has the best score, but its group's second best is poor; groups 1 and 2 are
    # strong in both experts and win the two places
    logits = torch.tensor([[6.0, -6.0, 3.0, 3.0, 2.5, 2.5, -1.0, -1.0]])
    _, ids = grouped_topk(logits, torch.zeros(8), r)
    assert sorted(ids[0].tolist()) == [2, 3]
    # with topk_group = n_group nothing is excluded and expert 0 is chosen
    wide = GroupedRouting(8, 2, n_group=4, topk_group=4, norm_topk_prob=True, scaling=1.0)
    assert 0 in grouped_topk(logits, torch.zeros(8), wide)[1][0].tolist()


def test_bias_moves_the_choice_but_not_the_weights() -> None:
    r = GroupedRouting(4, 1, n_group=1, topk_group=1, norm_topk_prob=False, scaling=2.0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = grouped_topk(logits, torch.tensor([0.0, 0.0, 0.5, 0.0]), r)
    assert ids.tolist() == [[2]]  # sigmoid(0) + 0.5 beats sigmoid(2)
    assert weights.item() == pytest.approx(2.0 * 0.5)  # the unbiased sigmoid(0), scaled


def test_router_module_equals_hf() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=24, n_routed_experts=16, num_experts_per_tok=4,
                              n_group=4, topk_group=2, norm_topk_prob=True,
                              routed_scaling_factor=2.5)
    torch.manual_seed(0)
    hf = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        hf.weight.normal_()
        hf.e_score_correction_bias.normal_(std=0.3)
    r = GroupedRouting(16, 4, n_group=4, topk_group=2, norm_topk_prob=True, scaling=2.5)
    ours = GroupedTopkRouter(24, r)
    ours.load_state_dict({"weight": hf.weight,
                          "e_score_correction_bias": hf.e_score_correction_bias})
    x = torch.randn(30, 24)
    _, hf_weights, hf_ids = hf(x)
    weights, ids = ours(x)
    for g, w in zip(as_dicts(weights, ids), as_dicts(hf_weights, hf_ids)):
        assert g.keys() == w.keys()
        assert all(g[e] == pytest.approx(w[e], rel=1e-6) for e in w)


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_experts=10, top_k=2, n_group=4, topk_group=2), "n_group=4"),
    (dict(num_experts=8, top_k=2, n_group=8, topk_group=2), "at least 2"),
    (dict(num_experts=8, top_k=2, n_group=4, topk_group=5), "topk_group=5"),
    (dict(num_experts=8, top_k=5, n_group=4, topk_group=2), "num_experts_per_tok=5"),
])
def test_bad_routing_numbers_are_named(kwargs: dict, field: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=field):
        GroupedRouting(**kwargs, norm_topk_prob=True, scaling=1.0)
