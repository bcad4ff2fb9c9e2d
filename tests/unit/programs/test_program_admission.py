"""ProgramAdmission: a program starts while the pool as it is now holds what the live programs
are still expected to add (the rest of their step, their later turns) plus the new one's first
step; pins taken back pause admission for a while."""
from __future__ import annotations

import pytest

from batchgen_data.programs.admission import COLD_OUTPUT_TOKENS, PoolState, ProgramAdmission


def test_step_blocks_counts_the_prompt_once_and_every_output() -> None:
    adm = ProgramAdmission(num_blocks=100, block_size=4)
    assert adm.step_blocks([10], [6]) == 4 + 1  # 16 tokens, one partial block
    assert adm.step_blocks([10, 12], [6, 6]) == 6 + 2  # 12 + 12 tokens: a fan-out
    assert adm.expected_output(10_000) == COLD_OUTPUT_TOKENS
    adm.step_done(3)
    adm.step_done(6)
    assert adm.expected_output(10_000) == 5 and adm.expected_output(2) == 2


class FakePool:
    """A pool of `num_blocks` where each live program references `held[pid]` blocks, all its
    own except `shared` blocks every program references (a system prompt, counted once)."""

    def __init__(self, num_blocks: int, shared: int = 0) -> None:
        self.num_blocks, self.shared = num_blocks, shared
        self.held: dict[str, int] = {}
        self.dropped = 0

    def state(self) -> PoolState:
        own = sum(h - self.shared for h in self.held.values())
        used = own + (self.shared if self.held else 0)
        return PoolState(self.num_blocks - used, self.dropped)


def fill(adm: ProgramAdmission, pool: FakePool, first: int, turn: int = 0,
         start: int = 0) -> int:
    """Start programs while admission allows; each holds its whole first step at once.
    Returns how many started."""
    n = start
    while adm.may_start(pool.state(), pool.held) and n < 10_000:
        pid = f"p{n}"
        adm.reserve(pid, first, turn)
        pool.held[pid] = first
        n += 1
    return n - start


def test_a_cold_start_admits_far_more_than_three_first_steps_each() -> None:
    """First steps of 30 blocks whose replies take 3 in a pool of 1000, 100 kept free. The rule
    before reserved three first steps per program until one ended (900 // 90 = 10 in flight);
    now each is expected to take two more turns of 3 blocks: (900 - 36) // 36 + 1 = 25."""
    adm = ProgramAdmission(num_blocks=1000, block_size=16, fill=0.9, cold_turns=2)
    pool = FakePool(1000)
    assert fill(adm, pool, 30, turn=3) == 25 > 900 // 90
    assert adm.max_in_flight == 25


def test_turns_and_their_growth_are_learnt_from_the_run() -> None:
    adm = ProgramAdmission(num_blocks=1000, block_size=16, cold_turns=2)
    assert [adm.turns_left(k) for k in (1, 2, 3, 4)] == [2.0, 1.0, 0.0, 0.0]
    for pid, steps in (("a", 3), ("b", 3), ("c", 1), ("d", 1)):
        for k in range(steps):
            adm.reserve(pid, 30 + 5 * k, turn=2)
        adm.end(pid)
    assert adm.num_ended == 4
    # half took 3 steps, half 1: at step 1 one more turn on average, at step 2 exactly one
    assert [adm.turns_left(k) for k in (1, 2, 3)] == [1.0, 1.0, 0.0]
    adm.reserve("e", 30, turn=2)
    held = {"e": 30}
    # e promises 1 turn of 5 blocks (the growth seen), a new one 30 + 5: 100 + 5 + 35 = 140
    assert adm.may_start(PoolState(140, 0), held)
    assert not adm.may_start(PoolState(139, 0), held)
    adm.end("x", completed=False)  # unknown: nothing changes
    adm.reserve("f", 30, turn=2)
    adm.end("f", completed=False)  # moved away: teaches nothing
    assert adm.num_ended == 4 and adm.turns_left(1) == 1.0


def test_growth_still_to_come_is_reserved() -> None:
    """A step that has just started holds its prompt; the blocks its outputs will take are not
    free for a new program."""
    adm = ProgramAdmission(num_blocks=100, block_size=4, fill=1.0, cold_turns=0)
    adm.reserve("a", 60)  # the first-step estimate is now 60
    assert not adm.may_start(PoolState(80, 0), {"a": 20})  # 80 free, 40 of them promised
    assert adm.may_start(PoolState(100, 0), {"a": 20})
    assert adm.may_start(PoolState(60, 0), {"a": 60})  # fully grown: nothing promised


def test_nothing_starts_when_the_pool_is_truly_full() -> None:
    adm = ProgramAdmission(num_blocks=100, block_size=4, fill=0.9, cold_turns=0)
    assert adm.may_start(PoolState(0, 0), {})  # nothing in flight: one always starts
    adm.reserve("a", 10)
    assert not adm.may_start(PoolState(10, 0), {"a": 10})  # 10 free, 10 kept as headroom
    assert adm.may_start(PoolState(20, 0), {"a": 10})
    # the free blocks are promised to the live step's outputs
    assert not adm.may_start(PoolState(25, 0), {"a": 0})


def test_shared_blocks_are_counted_once() -> None:
    """Ten programs that each reference a 20-block shared prefix plus 10 blocks of their own
    take 120 blocks of the pool, not 300: the pool's own count is what admission reads."""
    adm = ProgramAdmission(num_blocks=320, block_size=16, fill=1.0, cold_turns=0)
    pool = FakePool(320, shared=20)
    assert fill(adm, pool, 30) > 10


def test_the_guard_pauses_starts_after_a_pin_is_taken_back() -> None:
    adm = ProgramAdmission(num_blocks=1000, block_size=16)
    for pid in ("a", "b", "c"):
        adm.reserve(pid, 10)
    held = {"a": 10, "b": 10, "c": 10}
    assert adm.may_start(PoolState(900, 0), held)
    assert not adm.may_start(PoolState(900, 1), held)  # a pin was dropped: pause
    adm.step_done(5)
    adm.step_done(5)
    assert not adm.may_start(PoolState(900, 1), held)  # two of three steps done
    assert not adm.may_start(PoolState(900, 2), held)  # another drop: the wait starts again
    for _ in range(2):
        adm.step_done(5)
    assert not adm.may_start(PoolState(900, 2), held)
    adm.step_done(5)
    assert adm.may_start(PoolState(900, 2), held) and adm.num_paused == 4
    off = ProgramAdmission(num_blocks=1000, block_size=16, guard=False)
    off.reserve("a", 10)
    assert off.may_start(PoolState(900, 7), {"a": 10})


def test_admission_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="fill"):
        ProgramAdmission(10, 4, fill=0.0)
    with pytest.raises(ValueError, match="cold_turns"):
        ProgramAdmission(10, 4, cold_turns=-1)
