"""The host tier's micro-batch size comes from the cost model (issue 16): `HostKVTier.groups`
cuts a step's host-tier sequences into micro-batches whose size follows the measured rates (one
micro-batch when the host attends cheaper; else the square-root optimum, within staging)."""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from batchgen_data import LLM, SamplingParams
from batchgen_data.worker.kv_tier.tier import HostKVTier
from batchgen_data.worker.kv_tier.cost import KVRates

NUM_SEQS = 32
BLOCKS_PER_SEQ = 2
# the host computes at 1 flop/s: every micro-batch swaps; the link and the device are about as
# fast per sequence (a few us each), so the pipeline fill matters
SWAP_WINS = KVRates(copy_bytes_per_s=1e9, device_flops_per_s=1e9,
                    device_read_bytes_per_s=1e9, host_flops_per_s=1.0,
                    host_read_bytes_per_s=1.0, call_s=1e-6)
HOST_WINS = dataclasses.replace(SWAP_WINS, host_flops_per_s=1e15, host_read_bytes_per_s=1e15)


@pytest.fixture(scope="module")
def tier(deep_llama: Path) -> HostKVTier:
    llm = LLM(str(deep_llama), block_size=4, num_kv_blocks=12, host_kv_tier_bytes=4 << 20)
    tier = llm.engine.runner.kv_tier
    assert tier is not None
    return tier


def _groups(tier: HostKVTier, rates: KVRates, num_seqs: int = NUM_SEQS) -> list[list[int]]:
    tier.rates = rates
    first = tier.first_host_block
    tables = [[first + BLOCKS_PER_SEQ * i + j for j in range(BLOCKS_PER_SEQ)]
              for i in range(num_seqs)]
    seq_lens = [BLOCKS_PER_SEQ * tier.block_size] * num_seqs
    groups = tier.groups(tables, seq_lens, [1] * num_seqs)
    assert groups is not None
    assert sorted(i for g in groups for i in g) == list(range(num_seqs))  # each once
    return groups


def test_host_attention_takes_every_host_sequence_at_once(tier: HostKVTier) -> None:
    assert _groups(tier, HOST_WINS) == [list(range(NUM_SEQS))]


def test_swapped_micro_batches_follow_the_rates(tier: HostKVTier) -> None:
    small = len(_groups(tier, SWAP_WINS)[0])
    assert small == tier.micro_batch_seqs_last < NUM_SEQS
    # a dearer fixed cost per micro-batch: larger micro-batches
    larger = len(_groups(tier, dataclasses.replace(SWAP_WINS, call_s=16e-6))[0])
    assert larger == tier.micro_batch_seqs_last
    assert larger > small
    # a faster link exposes less per sequence: larger micro-batches too
    faster = len(_groups(tier, dataclasses.replace(SWAP_WINS, copy_bytes_per_s=16e9))[0])
    assert faster > small
    # every swapped micro-batch fits the staging cache
    huge = _groups(tier, dataclasses.replace(SWAP_WINS, call_s=1.0))
    assert all(len(g) * BLOCKS_PER_SEQ <= tier.staging_blocks for g in huge)


def test_several_swapped_micro_batches_match_resident(deep_llama: Path) -> None:
    """Steps with several swapped micro-batches of the cost model's size, each one's blocks
    copied while the one before it attended: the resident engine's greedy tokens."""
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randint(3, 12))]}
               for _ in range(10)]
    want = [o.outputs[0].token_ids
            for o in LLM(str(deep_llama), cpu_kernels=False).generate(prompts, sp,
                                                                     use_tqdm=False)]
    llm = LLM(str(deep_llama), cpu_kernels=False, block_size=4, num_kv_blocks=12,
              host_kv_tier_bytes=4 << 20)
    tier = llm.engine.runner.kv_tier
    tier.rates = SWAP_WINS
    host_groups: list[list[list[int]]] = []  # each step's host micro-batches
    plain = tier.groups

    def spy(tables, *args):  # type: ignore[no-untyped-def]
        groups = plain(tables, *args)
        host_groups.append([g for g in groups or [] if tier.on_host(tables[g[0]])])
        return groups

    tier.groups = spy
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert tier.modes["swap"] > tier.modes["host"] == 0
    # steps with several swapped micro-batches of more than one sequence
    assert any(len(gs) > 1 and max(map(len, gs)) > 1 for gs in host_groups)
    assert tier.caches.staging.prefetched > 0
