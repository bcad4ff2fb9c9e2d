"""What the scheduler reports to a placement policy (load, movable sequences) and the one
keep-or-drop-KV rule for held sequences; fake sequences, no model."""
from __future__ import annotations

import itertools

import pytest

from batchgen_data.config import SchedulerConfig
from batchgen_data.core import queue_report
from batchgen_data.core.kv.held_kv import decide_held_kv
from batchgen_data.core.scheduler import Scheduler
from batchgen_data.core.sequence import Sequence
from batchgen_data.core.kv.block_pool import BlockPool
from batchgen_data.core.kv.held_kv import HeldKVStore
from batchgen_data.sampling_params import SamplingParams

_ids = itertools.count()


def seq(prompt_len: int, rid: str | None = None) -> Sequence:
    sid = next(_ids)
    prompt = [sid * 1000 + i for i in range(prompt_len)]  # unique: no prefix sharing
    return Sequence(sid, rid or f"r{sid}", 0, prompt, SamplingParams(max_tokens=64), 0, 64)


def make(blocks: int = 64, tokens: int = 64, seqs: int = 4, host_tokens: int = 1000) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens)
    return Scheduler(cfg, BlockPool(blocks, 4), HeldKVStore(host_tokens * 8, 8))


def run_step(sch: Scheduler) -> None:
    """Pretend the model ran the scheduled step; finished prefills sample a token."""
    out = sch.schedule()
    for s, n in zip(out.seqs, out.num_new_tokens):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)


class _FakeKV:
    """Stands in for host KV: the tier only counts bytes."""


@pytest.mark.parametrize("keep,computed,room,copy_now,left", [
    (True, 10, 100, True, 10),  # wanted, has KV, fits: copy it to the host
    (True, 10, 5, False, 0),  # does not fit: dropped, recomputed later
    (False, 10, 100, False, 0),  # not wanted (recompute mode, hold(keep_kv=False))
    (True, 0, 100, False, 0),  # nothing computed: nothing to keep
])
def test_keep_or_drop_rule_for_kv_on_the_device(keep: bool, computed: int, room: int,
                                                copy_now: bool, left: int) -> None:
    host = HeldKVStore(room * 8, 8)
    s = seq(20)
    s.num_computed_tokens = computed
    assert decide_held_kv(s, host, keep) is copy_now
    assert s.num_computed_tokens == left and host.used_bytes == 0


def test_keep_or_drop_rule_for_kv_already_on_the_host() -> None:
    host = HeldKVStore(1000, 8)
    s = seq(20)
    s.num_computed_tokens = 10
    host._owners[s.seq_id] = 80  # what put() records, without real tensors
    host.used_bytes = 80
    s.held_kv = _FakeKV()
    assert not decide_held_kv(s, host, keep=True)  # stays where it is: nothing to copy
    assert s.held_kv is not None and s.num_computed_tokens == 10
    assert not decide_held_kv(s, host, keep=False)  # asked to drop it
    assert s.held_kv is None and s.num_computed_tokens == 0 and host.used_bytes == 0


def test_load_counts_queues_and_blocks() -> None:
    sch = make(seqs=2)
    for n in (8, 9, 10):
        sch.add(seq(n))
    run_step(sch)
    ld = queue_report.load(sch, "e1")
    assert (ld.engine_id, ld.waiting, ld.running, ld.held) == ("e1", 1, 2, 0)
    assert ld.total_blocks == 64 and ld.free_blocks == 64 - 2 - 3  # ceil(8/4), ceil(9/4)
    assert (ld.max_num_seqs, ld.block_size) == (2, 4)
    assert queue_report.load(sch, "e1", running=1).running == 1  # the simulator's mid-run count


def test_movable_lists_waiting_then_held_then_the_oldest_running() -> None:
    sch = make(seqs=3)
    young, old, mid = seq(4, "young"), seq(4, "old"), seq(4, "mid")
    for s in (young, old, mid):
        sch.add(s)
    run_step(sch)
    old.token_ids += [1, 2, 3]  # as if it had generated more
    mid.token_ids += [1]
    w1, w2 = seq(5, "w1"), seq(5, "w2")
    sch.add(w1)
    sch.add(w2)
    held = seq(5, "h")
    sch.held.append(held)
    got = [(r.request_id, r.kind) for r in queue_report.movable(sch)]
    assert got == [("w1", "waiting"), ("w2", "waiting"), ("h", "held"), ("old", "running"),
                   ("mid", "running"), ("young", "running")]
    assert [r.request_id for r in queue_report.movable(sch, max_running=1)][-1] == "old"
    assert "old" not in {r.request_id for r in queue_report.movable(sch, exclude={"old"})}
    first = queue_report.movable(sch)[3]
    assert (first.num_tokens, first.num_output_tokens) == (old.num_tokens, 4)
    assert first.num_computed_tokens == old.num_computed_tokens
