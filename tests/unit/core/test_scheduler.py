"""Scheduler budgets and preemption with fake sequences (no model)."""
from __future__ import annotations

import itertools

from batchgen_data.config import SchedulerConfig
from batchgen_data.core.scheduler import Scheduler
from batchgen_data.core.sequence import Sequence, SequenceStatus
from batchgen_data.core.kv.block_pool import BlockPool
from batchgen_data.core.kv.held_kv import HeldKVStore
from batchgen_data.sampling_params import SamplingParams

_ids = itertools.count()


def seq(prompt_len: int, max_tokens: int = 8, prompt: list[int] | None = None) -> Sequence:
    p = SamplingParams(max_tokens=max_tokens)
    sid = next(_ids)
    prompt = prompt or [sid * 1000 + i for i in range(prompt_len)]  # unique: no prefix sharing
    return Sequence(sid, "r", 0, prompt, p, 0, max_tokens)


def make(blocks: int = 64, bs: int = 4, tokens: int = 16, seqs: int = 8, host: int = 1 << 30,
         mode: str = "auto") -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens, preemption_mode=mode)
    return Scheduler(cfg, BlockPool(blocks, bs), HeldKVStore(host, 8))


def advance(sch: Scheduler, out) -> None:  # type: ignore[no-untyped-def]
    """Pretend the model ran: computed tokens catch up, finished prefills sample one token."""
    for s, n in zip(out.seqs, out.num_new_tokens):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)
    sch.after_step(out)


def test_token_budget_chunks_long_prompts() -> None:
    sch = make(tokens=16)
    long, short = seq(40), seq(5)
    sch.add(long)
    sch.add(short)
    out = sch.schedule()
    assert out.num_new_tokens == [16]  # the long prompt takes the whole budget
    advance(sch, out)
    out = sch.schedule()
    assert out.num_new_tokens == [16]
    advance(sch, out)
    out = sch.schedule()
    assert out.num_new_tokens == [8, 5]  # tail of the long prompt, then the short one
    assert all(n <= 16 for n in out.num_new_tokens) and out.total_tokens <= 16


def test_decodes_and_prefills_mix_without_phases() -> None:
    sch = make(tokens=8)
    a = seq(3)
    sch.add(a)
    advance(sch, sch.schedule())  # a prefilled, has one sampled token pending
    b = seq(20)
    sch.add(b)
    out = sch.schedule()
    assert [s is a for s in out.seqs] == [True, False]
    assert out.num_new_tokens == [1, 7]


def test_max_num_seqs_caps_running() -> None:
    sch = make(tokens=100, seqs=3)
    for _ in range(5):
        sch.add(seq(2))
    out = sch.schedule()
    assert len(out.seqs) == 3 and len(sch.waiting) == 2


def test_preemption_frees_blocks_and_never_deadlocks() -> None:
    # 12 blocks of 2 tokens; three sequences that together outgrow the cache
    sch = make(blocks=12, bs=2, tokens=64, seqs=8, host=0, mode="recompute")
    seqs = [seq(6, max_tokens=40) for _ in range(3)]
    for s in seqs:
        sch.add(s)
    steps = 0
    while any(s.num_output_tokens < 8 for s in seqs):
        out = sch.schedule()
        advance(sch, out)
        steps += 1
        assert steps < 500, "scheduler stopped making progress"
        used = sum(len(s.block_ids) for s in sch.running)
        assert used <= 12
    assert sch.num_preemptions > 0
    victims = [s for s in seqs if s.status == SequenceStatus.HELD]
    assert all(s.num_computed_tokens == 0 for s in victims)  # recompute mode dropped their KV


def test_victim_is_cheapest_to_bring_back() -> None:
    sch = make(blocks=6, bs=2, tokens=64, seqs=8, mode="swap")
    sch.watermark = 0
    old, young = seq(8), seq(3)
    sch.add(old)
    sch.add(young)
    advance(sch, sch.schedule())  # old: 4 blocks, young: 2 blocks -> cache full
    out = sch.schedule()  # old needs a 5th block for its next token
    assert out.held == [young] and list(sch.held) == [young]
    assert out.swap_out and out.swap_out[0][0] is young  # kept in host memory
    assert young.num_computed_tokens == 3 and young.status == SequenceStatus.HELD


def test_prefix_cache_hit_skips_computation() -> None:
    sch = make(tokens=64)
    a = seq(9, prompt=list(range(1, 10)))
    sch.add(a)
    advance(sch, sch.schedule())
    b = seq(9, prompt=list(range(1, 10)))  # same prompt
    sch.add(b)
    out = sch.schedule()
    i = out.seqs.index(b)
    assert b.num_cached_tokens == 8  # two full blocks of 4; the last token is always computed
    assert out.num_new_tokens[i] == 1
    assert b.block_ids[:2] == a.block_ids[:2]
