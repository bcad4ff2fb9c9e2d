"""The KV host tier in the engine (issue 16) on the CPU "device": with `host_kv_tier_bytes` and a
device KV cache too small for the batch, sequences run with their KV in host blocks (attended
on the host, or swapped into staging), greedy outputs equal the resident engine's, steps carry
more sequences than the device KV holds, and streamed weight bytes per generated token fall."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from batchgen_data import LLM, SamplingParams
from batchgen_data.worker.model_runner import ModelRunner
from batchgen_data.worker.offload import GIB, weight_bytes
from batchgen_data.worker.kv_tier.cost import KVRates

BLOCK = 4
DEVICE_BLOCKS = 12  # about two sequences of up to 20 tokens, with the watermark
HOST_BYTES = 4 << 20
# a link and device so fast, and a host so slow, that `choose_mode` swaps every micro-batch
SWAP_WINS = KVRates(1e12, 1e15, 1e15, 1.0, 1.0)


def _prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randint(3, 12))]}
            for _ in range(n)]


def _generate(llm: LLM, prompts: list[dict], max_tokens: int = 8) -> list[list[int]]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def _tiered(path: Path, **kw: object) -> LLM:
    kw = {"block_size": BLOCK, "num_kv_blocks": DEVICE_BLOCKS, "host_kv_tier_bytes": HOST_BYTES,
          **kw}
    return LLM(str(path), **kw)


def _assert_host_tier_ran(llm: LLM, mode: str) -> None:
    stats, tier = llm.engine.stats, llm.engine.runner.kv_tier
    assert tier is not None and stats.kv_host_seqs_peak >= 4
    assert stats.kv_host_bytes_moved > 0 and tier.modes[mode] > 0


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_host_tier_greedy_matches_resident(deep_llama: Path, cpu_kernels: bool) -> None:
    prompts = _prompts(8)
    want = _generate(LLM(str(deep_llama), cpu_kernels=cpu_kernels), prompts)
    llm = _tiered(deep_llama, cpu_kernels=cpu_kernels)
    assert _generate(llm, prompts) == want
    # on the CPU "device" the host attends over its own memory: no copy of the KV pays
    _assert_host_tier_ran(llm, "host")
    assert llm.engine.runner.kv_tier.modes["swap"] == 0


def test_swapped_micro_batches_match_resident(deep_llama: Path) -> None:
    prompts = _prompts(8, seed=1)
    want = _generate(LLM(str(deep_llama), cpu_kernels=False), prompts)
    llm = _tiered(deep_llama, cpu_kernels=False)
    llm.engine.runner.kv_tier.rates = SWAP_WINS
    assert _generate(llm, prompts) == want
    _assert_host_tier_ran(llm, "swap")
    assert llm.engine.runner.kv_tier.modes["host"] == 0


def test_moe_host_tier_greedy_matches_resident(deep_qwen3_moe: Path) -> None:
    prompts = _prompts(8, seed=2)
    want = _generate(LLM(str(deep_qwen3_moe)), prompts)
    llm = _tiered(deep_qwen3_moe)
    assert _generate(llm, prompts) == want
    _assert_host_tier_ran(llm, "host")


def test_off_by_default(deep_llama: Path) -> None:
    llm = LLM(str(deep_llama), block_size=BLOCK, num_kv_blocks=DEVICE_BLOCKS)
    _generate(llm, _prompts(4), max_tokens=2)
    assert llm.engine.runner.kv_tier is None and llm.engine.pool.num_host_blocks == 0
    assert llm.engine.stats.kv_host_seqs_peak == llm.engine.stats.kv_host_bytes_moved == 0


def test_host_tier_grows_streamed_steps(deep_llama: Path) -> None:
    """Weights streamed: the host tier lets a step carry more sequences than the device KV
    holds, so each streamed layer's copy serves more tokens."""
    prompts = _prompts(16, seed=3)
    resident = LLM(str(deep_llama), cpu_kernels=False)
    want = _generate(resident, prompts)
    offload_gb = 0.6 * weight_bytes(resident.engine.runner.model) / GIB
    device_only = LLM(str(deep_llama), cpu_kernels=False, cpu_offload_gb=offload_gb,
                      block_size=BLOCK, num_kv_blocks=DEVICE_BLOCKS)
    tiered = _tiered(deep_llama, cpu_kernels=False, cpu_offload_gb=offload_gb)
    per_token, batch = [], []
    for llm in (device_only, tiered):
        assert llm.engine.runner.weight_store is not None
        out = _generate(llm, prompts)
        assert out == want
        per_token.append(llm.engine.stats.offload_bytes_moved / sum(map(len, out)))
        batch.append(llm.engine.stats.max_batch_seqs)
    _assert_host_tier_ran(tiered, "host")
    assert batch[1] >= 2 * batch[0], batch
    assert per_token[1] * 2 < per_token[0], per_token


def test_host_tier_sequences_can_be_preempted(deep_llama: Path) -> None:
    """A host tier of a few blocks: host-tier sequences run out of blocks and are held (their
    KV read from the host blocks), then resumed; outputs are unchanged."""
    prompts = _prompts(8, seed=4)
    want = _generate(LLM(str(deep_llama), cpu_kernels=False), prompts, max_tokens=12)
    probe = LLM(str(deep_llama), cpu_kernels=False)
    block_bytes = ModelRunner.kv_bytes_per_token(probe.engine.runner.model,
                                                 probe.engine.runner.dtype) * BLOCK
    llm = _tiered(deep_llama, cpu_kernels=False, host_kv_tier_bytes=14 * block_bytes)
    runner = llm.engine.runner
    read_from_host: list[bool] = []
    read_kv = runner.read_kv

    def spy(block_ids: list[int], num_tokens: int):  # type: ignore[no-untyped-def]
        read_from_host.append(runner.kv_tier.on_host(block_ids))
        return read_kv(block_ids, num_tokens)

    runner.read_kv = spy
    assert _generate(llm, prompts, max_tokens=12) == want
    assert llm.engine.stats.num_preemptions > 0 and any(read_from_host), read_from_host
    assert llm.engine.stats.kv_host_seqs_peak >= 2
