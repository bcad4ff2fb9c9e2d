"""The KV host tier in the block pool and the scheduler (issue 16), with fake sequences: new
sequences spill to host blocks when the device tier is full, a sequence's blocks stay in one
tier, prefix matches never cross tiers, and a host-tier sequence short of blocks preempts a
host-tier victim, whose swapped-out blocks are host ids. The load report (placement) counts
the host tier."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from batchgen_data.config import SchedulerConfig
from batchgen_data.core import queue_report
from batchgen_data.core.scheduler import Scheduler
from batchgen_data.core.sequence import Sequence, SequenceStatus
from batchgen_data.core.kv.block_pool import BlockPool
from batchgen_data.core.kv.held_kv import HeldKVStore
from batchgen_data.placement import PlacementConfig, has_free_seat
from batchgen_data.sampling_params import SamplingParams

_ids = itertools.count()


def seq(prompt_len: int, prompt: list[int] | None = None) -> Sequence:
    sid = next(_ids)
    prompt = prompt or [sid * 1000 + i for i in range(prompt_len)]
    return Sequence(sid, "r", 0, prompt, SamplingParams(max_tokens=32), 0, 32)


def make(device: int, host: int, bs: int = 4, mode: str = "swap") -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256, preemption_mode=mode)
    return Scheduler(cfg, BlockPool(device, bs, num_host_blocks=host), HeldKVStore(1 << 30, 8))


def advance(sch: Scheduler, out) -> None:  # type: ignore[no-untyped-def]
    for s, n in zip(out.seqs, out.num_new_tokens):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)
    sch.after_step(out)


def test_pool_allocates_and_frees_per_tier() -> None:
    pool = BlockPool(4, 2, num_host_blocks=3)
    dev, host = pool.allocate(2), pool.allocate(3, host=True)
    assert dev == [0, 1] and host == [4, 5, 6] and all(map(pool.is_host, host))
    assert (pool.num_free, pool.num_free_host, pool.usage) == (2, 0, 0.5)
    with pytest.raises(MemoryError, match="host"):
        pool.allocate(1, host=True)
    pool.free(host)
    assert (pool.num_free, pool.num_free_host) == (2, 3)  # freed into their own tier


def test_prefix_match_stays_in_one_tier() -> None:
    pool = BlockPool(4, 2, num_host_blocks=4)
    toks = [1, 2, 3, 4, 5, 6]
    dev = pool.allocate(1)
    h = pool.register(dev[0], None, (1, 2))
    host = pool.allocate(2, host=True)  # a host-tier sequence's blocks 1 and 2
    h = pool.register(host[0], h, (3, 4))
    pool.register(host[1], h, (5, 6))
    blocks, _ = pool.match_prefix(toks, 6)
    assert blocks == dev  # the host blocks chained after it are not taken


def test_new_sequences_spill_to_host_when_device_is_full() -> None:
    sch = make(device=6, host=40)
    seqs = [seq(7) for _ in range(6)]  # two blocks each
    for s in seqs:
        sch.add(s)
    out = sch.schedule()
    assert len(out) == 6  # without the host tier, the device (6 blocks) holds two of them
    on_host = [sch.pool.is_host(s.block_ids[0]) for s in seqs]
    assert on_host.count(False) == 2 and on_host.count(True) == 4
    for s in seqs:  # all of a sequence's blocks in one tier
        assert len({sch.pool.is_host(b) for b in s.block_ids}) == 1


def test_without_host_tier_the_step_is_bounded_by_device_blocks() -> None:
    sch = make(device=6, host=0)
    for _ in range(6):
        sch.add(seq(7))
    assert len(sch.schedule()) == 2


def test_prefix_in_full_device_tier_restarts_in_host_tier() -> None:
    sch = make(device=4, host=16)
    shared = list(range(100, 108))
    first = seq(0, shared + [1])
    sch.add(first)
    advance(sch, sch.schedule())  # 3 device blocks, 2 registered: one left, the watermark's
    late = seq(0, shared + [2])
    sch.add(late)
    out = sch.schedule()
    assert late in out.seqs and sch.pool.is_host(late.block_ids[0])
    assert late.num_cached_tokens == 0  # its prefix hits were given back: computed again
    assert out.num_new_tokens[out.seqs.index(late)] == 9


def test_host_tier_sequence_preempts_a_host_victim() -> None:
    sch = make(device=4, host=4, bs=4)
    a, b, c = seq(11), seq(4), seq(3)  # a fills the device; b, c go to the host tier
    for s in (a, b, c):
        sch.add(s)
    out = sch.schedule()
    assert out.seqs == [a, b, c]
    assert not sch.pool.is_host(a.block_ids[0])
    assert sch.pool.is_host(b.block_ids[0]) and sch.pool.is_host(c.block_ids[0])
    advance(sch, out)
    for _ in range(8):  # decode until the host tier runs out of blocks
        out = sch.schedule()
        if out.held:
            break
        advance(sch, out)
    assert out.held and all(s is not a for s in out.held)  # a device sequence frees nothing
    victim, blocks = out.swap_out[0]
    assert victim.status == SequenceStatus.HELD and all(map(sch.pool.is_host, blocks))


def test_load_counts_the_host_tier() -> None:
    sch = make(device=4, host=16)
    for s in (seq(7), seq(7), seq(7)):  # 2 device blocks, 2 x 2 host blocks
        sch.add(s)
    advance(sch, sch.schedule())
    load = queue_report.load(sch, "e0")
    assert (load.free_blocks, load.total_blocks) == (2, 4)
    assert (load.free_host_blocks, load.host_blocks) == (12, 16)
    assert load.kv_tokens == 6 * 4  # device and host-tier blocks in use
    cfg = PlacementConfig(memory_tight_fraction=0.6)
    # the device tier alone is tight (2 of 4 free); the host tier still seats new rows
    assert load.free_blocks < 0.6 * load.total_blocks and load.has_kv_room(0.6)
    assert has_free_seat(load, cfg)
    full = dataclasses.replace(load, free_host_blocks=0)
    assert not full.has_kv_room(0.6) and not has_free_seat(full, cfg)
