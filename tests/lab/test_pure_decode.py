"""The simulator's pure-decode check (`decode_run.next_is_pure_decode`) over the real scheduler
with fake sequences: a run of decode steps is planned only when the next schedule would compute
one token for every running sequence and admit nobody, the host tier's room counted as the
scheduler's own admission test (`Scheduler.admits`) counts it."""
from __future__ import annotations

import itertools

from batchgen_data.config import SchedulerConfig
from batchgen_data.core.kv.block_pool import BlockPool
from batchgen_data.core.kv.held_kv import HeldKVStore
from batchgen_data.core.scheduler import Scheduler
from batchgen_data.core.sequence import Sequence
from batchgen_data.sampling_params import SamplingParams
from batchgen_lab.sim.decode_run import next_is_pure_decode

_ids = itertools.count()


def seq(prompt_len: int) -> Sequence:
    sid = next(_ids)
    prompt = [sid * 1000 + i for i in range(prompt_len)]  # unique: no prefix sharing
    return Sequence(sid, f"r{sid}", 0, prompt, SamplingParams(max_tokens=64), 0, 64)


def make(blocks: int = 64, tokens: int = 64, seqs: int = 4, host: int = 0) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens)
    return Scheduler(cfg, BlockPool(blocks, 4, num_host_blocks=host), HeldKVStore(1 << 30, 8))


def run_step(sch: Scheduler) -> None:
    """Pretend the model ran the scheduled step; finished prefills sample a token."""
    out = sch.schedule()
    for s, n in zip(out.seqs, out.num_new_tokens):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)
    sch.after_step(out)


def test_pure_decode_is_recognised_only_when_nothing_else_can_happen() -> None:
    sch = make(seqs=2)
    sch.add(seq(6))
    assert not next_is_pure_decode(sch)  # nothing running yet
    run_step(sch)
    assert next_is_pure_decode(sch)  # one decode, empty queue
    sch.add(seq(40))
    assert not next_is_pure_decode(sch)  # the newcomer would be admitted
    run_step(sch)
    sch.add(seq(3))
    assert next_is_pure_decode(sch)  # every seat taken: the queue waits

    chunked = make(tokens=16)
    chunked.add(seq(40))
    run_step(chunked)
    assert not next_is_pure_decode(chunked)  # 24 prompt tokens still pending

    tight = make(blocks=6)
    tight.add(seq(6))
    run_step(tight)
    tight.add(seq(30))
    assert next_is_pure_decode(tight)  # a free seat, but the queue head does not fit


def test_pure_decode_check_sees_room_in_the_host_tier() -> None:
    sch = make(blocks=4, host=8, seqs=64, tokens=256)
    sch.add(seq(7))  # two device blocks: the device keeps one free (its watermark), one spare
    run_step(sch)
    assert next_is_pure_decode(sch)  # nothing waits
    sch.add(seq(7))  # the device cannot take it, the host tier can: the next step admits it
    assert not next_is_pure_decode(sch)
    out = sch.schedule()
    assert len(out) == 2 and sch.pool.is_host(out.seqs[1].block_ids[0])


def test_pure_decode_check_when_both_tiers_are_full() -> None:
    sch = make(blocks=4, host=2, seqs=64, tokens=256)
    for s in (seq(7), seq(7)):  # one per tier
        sch.add(s)
    run_step(sch)
    sch.add(seq(7))  # room in neither tier: the next step only decodes
    assert next_is_pure_decode(sch)
