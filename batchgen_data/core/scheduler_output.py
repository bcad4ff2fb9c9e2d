"""What the scheduler hands a step (`SchedulerOutput`: the sequences and their token counts, the
KV moves before the step runs) and the token budget of a step (`step_token_budget`).
`core/scheduler.py` fills them; the runner, the stepper and the statistics read them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchgen_data.config import SchedulerConfig
from batchgen_data.core.sequence import Sequence


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # KV to copy to host before the step runs (the blocks are already released in the pool)
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    # sequences whose host KV must be copied into their new blocks before the step runs
    swap_in: list[Sequence] = field(default_factory=list)
    held: list[Sequence] = field(default_factory=list)  # preempted: held for memory this step
    # images for the step's encoder batch, before its forward (core/multimodal.ImageItem):
    # those of the admitted prompts that the engine's encoder cache lacks, each once
    encode: list[Any] = field(default_factory=list)
    # the first sequences' computed tokens and token counts as scheduled [len], when the
    # scheduler read them as arrays (the running ones, none preempted): the runner's `prepare`
    # takes them instead of reading the sequences again; sequences admitted after them are not
    # covered (`len` < `len(seqs)`)
    arrays: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


def step_token_budget(config: SchedulerConfig, moe_routing: tuple[int, int] | None) -> int:
    """Tokens one step may compute. For an MoE model with E experts and top-k routing a step of
    T tokens gives each expert T * k / E tokens on average, so a budget of
    `max_tokens_per_expert` per expert allows E / k times as many tokens per step, capped by
    `max_num_batched_tokens` (docs/moe.md). Dense models, and MoE ones without a per-expert
    budget, keep `max_num_batched_tokens`."""
    if moe_routing is None or config.max_tokens_per_expert is None:
        return config.max_num_batched_tokens
    num_experts, top_k = moe_routing
    per_step = config.max_tokens_per_expert * num_experts // top_k
    return max(1, min(config.max_num_batched_tokens, per_step))
