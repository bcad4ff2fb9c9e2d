"""The scheduler's per-expert token budget for MoE models and the engine's tokens-per-expert
statistics (docs/moe.md)."""
from __future__ import annotations

import pytest
import torch

from batchgen_data.config import SchedulerConfig
from batchgen_data.core.scheduler import step_token_budget
from batchgen_data.engine.stats import EngineStats


def test_dense_models_and_unset_budgets_keep_max_num_batched_tokens() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_tokens_per_expert=4)
    assert step_token_budget(cfg, None) == 512
    assert step_token_budget(SchedulerConfig(max_num_batched_tokens=512), (32, 4)) == 512


@pytest.mark.parametrize("per_expert,experts,top_k,want", [
    (16, 32, 4, 128),    # 128 tokens * 4 choices / 32 experts = 16 per expert
    (100, 32, 4, 512),   # capped by max_num_batched_tokens
    (1, 8, 8, 1),        # every token goes to every expert
])
def test_per_expert_budget_sets_the_step_budget(per_expert: int, experts: int, top_k: int,
                                                want: int) -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_tokens_per_expert=per_expert)
    assert step_token_budget(cfg, (experts, top_k)) == want


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_expert"):
        SchedulerConfig(max_tokens_per_expert=0)


def test_tokens_per_expert_averages_each_layer_of_each_step() -> None:
    stats = EngineStats()
    assert stats.as_dict()["tokens_per_expert"] is None
    stats.tokens_per_expert.record(torch.zeros(0, 0, dtype=torch.long))  # a dense step
    assert stats.as_dict()["tokens_per_expert"] is None
    stats.tokens_per_expert.record(torch.tensor([[4, 0, 2, 2], [1, 1, 1, 5]]))
    stats.tokens_per_expert.record(torch.tensor([[0, 0, 0, 8], [2, 2, 2, 2]]))
    assert stats.as_dict()["tokens_per_expert"] == {
        "mean": 2.0, "min": (0 + 1 + 0 + 2) / 4, "max": (4 + 5 + 8 + 2) / 4, "layer_steps": 4}
