"""Admission control for programs: when may one more program start on this engine?

A program keeps its conversation's KV between steps (core/pins.py), so every program in
flight holds memory until it ends. Start them all at once and their steps overflow the KV
pool: pins are taken back, the next steps prefill the whole conversation again, and the
program runs no better than three separate passes. Start too few and the decode batches are
smaller than a chained stage's, which on a device where a decode step costs about the same for
20 sequences as for 150 loses more than the prefill saved.

So a program starts while the pool, as it is now, has room for what the live programs are
still expected to add to it plus the new program's first step, the way a stage's rows are
admitted while their step fits. The pool's real state is the base: its free blocks (cached but
unreferenced ones count: they are evictable), so blocks shared by several programs (a system
prompt) count once and a program's reservation shrinks as its blocks are really taken. From
that, each live program is expected to add
  - what its current step still has to grow: the step's expected end (its prompt once, every
    expected output) less the blocks the program references now (its pin, its running
    sequences), and
  - the turns it is still expected to take, each the mean growth seen from one step to the next
    (before any: the step's expected output). How many turns is learnt from the programs that
    ended (the mean of their remaining steps, given the step a live one is at); before any has
    ended, `cold_turns` more (a draft → critique → revise program's two).
A `1 - fill` share of the pool stays free as headroom. A program that turns out to need more
than expected does not stall anyone: when a next turn does not fit, the engine takes back the pin
of the program queued last (its step is furthest from running) and that one conversation is
prefilled again, a recompute, never a changed token.

The guard against thrash: pins taken back mean the in-flight set is too large for its later
steps, so after the engine reports a dropped pin no program starts until as many steps as there
are programs in flight have finished with no further drop (about one step of each). At least
one program is always in flight.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# expected output of a step before any step has finished, when its max_tokens is larger
COLD_OUTPUT_TOKENS = 256


@dataclass(frozen=True)
class PoolState:
    """What admission reads from the engine: the device pool now and the pin drops so far."""
    free_blocks: int  # unreferenced device blocks (cached ones included: evictable)
    dropped_pins: int  # pins the engine has taken back since it started (a counter)

    @classmethod
    def of(cls, engine: Any) -> "PoolState":
        return cls(engine.pool.num_free, engine.pins.num_dropped)


class ProgramAdmission:
    def __init__(self, num_blocks: int, block_size: int, fill: float = 0.9,
                 cold_turns: int = 2, guard: bool = True) -> None:
        if not 0.0 < fill <= 1.0:
            raise ValueError(f"fill={fill!r}: must be in (0, 1]")
        if cold_turns < 0:
            raise ValueError(f"cold_turns={cold_turns!r}: must be >= 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.headroom = num_blocks - int(num_blocks * fill)  # blocks kept free
        self.cold_turns = cold_turns
        self.guard = guard
        self._need: dict[str, int] = {}  # live program -> blocks its current step will hold
        self._turn: dict[str, int] = {}  # live program -> its prior for one more turn's growth
        self._step: dict[str, int] = {}  # live program -> steps it has submitted
        self._firsts = [0, 0, 0]  # first steps' needs and turn priors summed, and how many
        self._growth = [0, 0]  # growth from one step to the next, summed, and how many
        self._ended: dict[int, int] = {}  # steps a completed program took -> how many did
        self._out_tokens = 0  # output tokens of finished steps, and how many steps
        self._out_steps = 0
        self._drops_seen = 0  # the engine's dropped-pin counter at the last look
        self._paused_until = 0  # no start until `_out_steps` reaches this (the guard)
        self.max_in_flight = 0  # most programs live at once
        self.num_paused = 0  # starts the guard put off
        self.num_ended = 0

    @classmethod
    def for_engine(cls, engine: Any, **kwargs: Any) -> "ProgramAdmission":
        return cls(engine.pool.num_blocks, engine.pool.block_size, **kwargs)

    def __contains__(self, pid: str) -> bool:
        return pid in self._need

    @property
    def in_flight(self) -> int:
        return len(self._need)

    def expected_output(self, limit: int) -> int:
        """Tokens a step allowed `limit` output tokens is expected to generate."""
        if self._out_steps == 0:
            return min(limit, COLD_OUTPUT_TOKENS)
        return min(limit, -(-self._out_tokens // self._out_steps))

    def step_blocks(self, prompt_lens: list[int], limits: list[int]) -> int:
        """Blocks a step of `len(prompt_lens)` generations is expected to hold at its end: the
        longest prompt once (a fan-out's prompts share their prefix), every expected output,
        and a partly filled last block per generation."""
        tokens = max(prompt_lens) + sum(self.expected_output(n) for n in limits)
        return -(-tokens // self.block_size) + len(prompt_lens)

    def turn_blocks(self, limits: list[int]) -> int:
        """Prior for what the next turn adds: at least this step's expected replies."""
        return -(-sum(self.expected_output(n) for n in limits) // self.block_size) + 1

    def turns_left(self, step: int) -> float:
        """More steps a program that has submitted `step` steps is expected to take."""
        if not self._ended:
            return float(max(0, self.cold_turns + 1 - step))
        longer = [(n, k) for n, k in self._ended.items() if n >= step]
        count = sum(k for _, k in longer)
        return sum((n - step) * k for n, k in longer) / count if count else 0.0

    def may_start(self, pool: PoolState, held: dict[str, int]) -> bool:
        """May another program start now? `held`: blocks each live program references now (its
        pin and its running sequences; a program missing from it holds none)."""
        self._watch(pool.dropped_pins)
        if not self._need:
            return True
        if self._out_steps < self._paused_until:
            self.num_paused += 1
            return False
        promised = sum(max(0, need - held.get(pid, 0)) + self._later(pid)
                       for pid, need in self._need.items())
        new = 0.0  # the next program: the mean first step so far, and its later turns
        if self._firsts[2]:
            first, prior, count = self._firsts
            new = first / count + self.turns_left(1) * self._turn_growth(round(prior / count))
        return pool.free_blocks - self.headroom - promised >= new

    def reserve(self, pid: str, blocks: int, turn: int = 0) -> None:
        """`pid` submitted a step expected to hold `blocks` at its end (`step_blocks`); `turn`:
        the prior for its next turn's growth (`turn_blocks`)."""
        if pid in self._need:
            self._growth[0] += max(0, blocks - self._need[pid])
            self._growth[1] += 1
        else:
            self._firsts = [self._firsts[0] + blocks, self._firsts[1] + turn, self._firsts[2] + 1]
        self._need[pid] = blocks
        self._turn[pid] = turn
        self._step[pid] = self._step.get(pid, 0) + 1
        self.max_in_flight = max(self.max_in_flight, len(self._need))

    def step_done(self, output_tokens: int) -> None:
        self._out_tokens += output_tokens
        self._out_steps += 1

    def end(self, pid: str, completed: bool = True) -> None:
        """`pid` left: it ended (`completed`: its step count teaches the estimate) or was moved
        to another engine."""
        self._turn.pop(pid, None)
        steps = self._step.pop(pid, 0)
        if self._need.pop(pid, None) is not None and completed:
            self.num_ended += 1
            self._ended[steps] = self._ended.get(steps, 0) + 1

    def _turn_growth(self, prior: int) -> float:
        return self._growth[0] / self._growth[1] if self._growth[1] else float(prior)

    def _later(self, pid: str) -> float:
        return self.turns_left(self._step[pid]) * self._turn_growth(self._turn[pid])

    def _watch(self, dropped: int) -> None:
        if self.guard and dropped > self._drops_seen:
            # wait out about one step of every program now in flight, drop-free
            self._paused_until = self._out_steps + max(1, len(self._need))
        self._drops_seen = max(self._drops_seen, dropped)
