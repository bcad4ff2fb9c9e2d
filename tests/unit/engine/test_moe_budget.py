"""The scheduler's per-expert token budget for MoE models (docs/moe.md)."""
from __future__ import annotations

import pytest

from batchgen_data.config import SchedulerConfig
from batchgen_data.engine.scheduler import step_token_budget


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
