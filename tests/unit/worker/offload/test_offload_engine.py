"""Weight offload (issue 16) on the CPU "device": greedy outputs identical to the resident path
with most layers streamed, the resident weight peak within the budget, and bytes moved per
generated token falling as the batch grows."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from batchgen_data import LLM, SamplingParams
from batchgen_data.worker.offload import GIB


def _prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randint(3, 12))]}
            for _ in range(n)]


def _generate(llm: LLM, prompts: list[dict], max_tokens: int = 8) -> list[list[int]]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def _total_weight_bytes(llm: LLM) -> int:
    from batchgen_data.worker.offload import weight_bytes
    return weight_bytes(llm.engine.runner.model)


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_offloaded_greedy_matches_resident(deep_llama: Path, cpu_kernels: bool) -> None:
    prompts = _prompts(5)
    resident = LLM(str(deep_llama), cpu_kernels=cpu_kernels)
    total = _total_weight_bytes(resident)
    want = _generate(resident, prompts)
    # keep a quarter of the weights on the "device": most layers stream
    offload_gb = 0.75 * total / GIB
    llm = LLM(str(deep_llama), cpu_kernels=cpu_kernels, cpu_offload_gb=offload_gb)
    store = llm.engine.runner.weight_store
    assert store is not None and len(store.layers) >= len(llm.engine.runner.model.layers) - 1
    assert _generate(llm, prompts) == want
    stats = llm.engine.stats
    assert stats.offload_bytes_moved >= store.offloaded_bytes  # every streamed layer came in
    assert 0 < stats.offload_peak_resident_bytes <= total - int(offload_gb * GIB)


def test_offloaded_moe_greedy_matches_resident(deep_qwen3_moe: Path) -> None:
    prompts = _prompts(5, seed=2)
    resident = LLM(str(deep_qwen3_moe))
    total = _total_weight_bytes(resident)
    want = _generate(resident, prompts)
    offload_gb = 0.75 * total / GIB
    llm = LLM(str(deep_qwen3_moe), cpu_offload_gb=offload_gb)
    assert len(llm.engine.runner.weight_store.layers) >= 8
    assert _generate(llm, prompts) == want
    assert 0 < llm.engine.stats.offload_peak_resident_bytes <= total - int(offload_gb * GIB)


def test_no_offload_counts_nothing(deep_llama: Path) -> None:
    llm = LLM(str(deep_llama))
    _generate(llm, _prompts(2), max_tokens=2)
    assert llm.engine.runner.weight_store is None
    assert llm.engine.stats.offload_bytes_moved == 0


def test_bytes_moved_per_token_fall_with_batch(deep_llama: Path) -> None:
    resident = LLM(str(deep_llama), cpu_kernels=False)
    offload_gb = 0.6 * _total_weight_bytes(resident) / GIB
    prompts = _prompts(16, seed=1)
    per_token = []
    for batch in (1, 4, 16):
        llm = LLM(str(deep_llama), cpu_kernels=False, cpu_offload_gb=offload_gb,
                  max_num_seqs=batch)
        out = _generate(llm, prompts, max_tokens=6)
        per_token.append(llm.engine.stats.offload_bytes_moved / sum(map(len, out)))
    assert per_token[0] > 2 * per_token[1] > 4 * per_token[2] > 0, per_token


def test_absolute_weight_budget(deep_llama: Path) -> None:
    prompts = _prompts(3, seed=3)
    resident = LLM(str(deep_llama), cpu_kernels=False)
    total = _total_weight_bytes(resident)
    want = _generate(resident, prompts)
    budget = total // 3
    llm = LLM(str(deep_llama), cpu_kernels=False, weight_memory_bytes=budget)
    assert _generate(llm, prompts) == want
    assert 0 < llm.engine.stats.offload_peak_resident_bytes <= budget
    roomy = LLM(str(deep_llama), cpu_kernels=False, weight_memory_bytes=2 * total)
    assert roomy.engine.runner.weight_store is None  # everything fits: nothing streams


def test_offload_budget_too_small_is_refused(deep_llama: Path) -> None:
    resident = LLM(str(deep_llama), cpu_kernels=False)
    with pytest.raises(ValueError, match="cpu_offload_gb"):
        LLM(str(deep_llama), cpu_kernels=False,
            cpu_offload_gb=0.999 * _total_weight_bytes(resident) / GIB)


def test_cpu_offload_gb_validated() -> None:
    with pytest.raises(ValueError, match="cpu_offload_gb"):
        LLM(cpu_offload_gb=-1)
