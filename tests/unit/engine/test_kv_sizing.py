"""The KV cache is sized to the job (max_num_seqs x max_model_len), capped by the budget."""
from __future__ import annotations

import torch

from batchgen_data.config import CacheConfig
from batchgen_data.engine import setup

CPU = torch.device("cpu")


def test_small_jobs_get_only_what_they_can_use() -> None:
    cc = CacheConfig(block_size=16)
    # 4 sequences of 100 tokens: 7 blocks each, plus one spare
    assert setup._num_blocks(cc, CPU, per_token=1000, max_len=100, max_seqs=4) == 4 * 7 + 1


def test_big_jobs_are_capped_by_the_budget() -> None:
    per_token, block_bytes = 46080, 46080 * 16  # SmolLM2-135M in fp32
    default = setup._num_blocks(CacheConfig(), CPU, per_token, max_len=8192, max_seqs=256)
    assert default == setup._CPU_KV_BYTES // block_bytes
    explicit = CacheConfig(kv_cache_memory_bytes=100 * block_bytes)
    assert setup._num_blocks(explicit, CPU, per_token, max_len=8192, max_seqs=256) == 100
    # an explicit budget larger than the job needs is not filled
    assert setup._num_blocks(explicit, CPU, per_token, max_len=32, max_seqs=2) == 2 * 2 + 1
