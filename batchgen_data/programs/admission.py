"""Admission control for programs: how many may be in flight on one engine at a time.

A program keeps its conversation's KV between steps (engine/pins.py), so every program in
flight holds memory until it ends, and that grows with each step. Start them all at once and
their contexts overflow the KV pool: pins are taken back, the next steps prefill the whole
conversation again, and the program runs no better than three separate passes. So, as SGLang's
`run_batch` bounds the programs in flight by its thread count, a runner here starts a program
only while the KV the live ones are expected to reach, plus the new one's, fits a share of the
pool. The expectation is learnt from the run itself: a program's reservation is the larger of
what its current step needs and the mean peak of the programs that already ended (before any
has ended: `cold_growth` times the program's first step). A slow program holds only its own
reservation; as programs end, new ones take the room.

The estimate need not be exact: the engine takes pins back selectively when it runs short, so
a miss costs a few recomputed prefixes, never a stall. At least one program is always in flight.
"""
from __future__ import annotations

from typing import Any

# expected output of a step before any step has finished, when its max_tokens is larger
COLD_OUTPUT_TOKENS = 256


class ProgramAdmission:
    def __init__(self, num_blocks: int, block_size: int, fill: float = 0.9,
                 cold_growth: float = 3.0) -> None:
        if not 0.0 < fill <= 1.0:
            raise ValueError(f"fill={fill!r}: must be in (0, 1]")
        if cold_growth < 1.0:
            raise ValueError(f"cold_growth={cold_growth!r}: must be >= 1")
        self.budget = max(1, int(num_blocks * fill))  # blocks the live programs may reserve
        self.block_size = block_size
        self.cold_growth = cold_growth
        self._need: dict[str, int] = {}  # live program -> blocks its current step needs
        self._first: dict[str, int] = {}  # live program -> blocks its first step needed
        self._peak: dict[str, int] = {}  # live program -> most blocks a step of it needed
        self._ended_peaks = 0  # sum of the peaks of the programs that ended
        self.num_ended = 0
        self._out_tokens = 0  # output tokens of finished steps, and how many steps
        self._out_steps = 0
        self.max_in_flight = 0  # most programs live at once

    @classmethod
    def for_engine(cls, engine: Any, **kwargs: Any) -> "ProgramAdmission":
        return cls(engine.pool.num_blocks, engine.pool.block_size, **kwargs)

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

    def may_start(self) -> bool:
        """May another program start now?"""
        if not self._need:
            return True
        reserved = sum(self._reserved(pid) for pid in self._need)
        return reserved + self._expected_peak(None) <= self.budget

    def reserve(self, pid: str, blocks: int) -> None:
        """`pid` submitted a step expected to need `blocks` (`step_blocks`)."""
        self._first.setdefault(pid, blocks)
        self._need[pid] = blocks
        self._peak[pid] = max(self._peak.get(pid, 0), blocks)
        self.max_in_flight = max(self.max_in_flight, len(self._need))

    def step_done(self, output_tokens: int) -> None:
        self._out_tokens += output_tokens
        self._out_steps += 1

    def end(self, pid: str, completed: bool = True) -> None:
        """`pid` left: it ended (`completed`: its peak teaches the estimate) or was moved away."""
        self._need.pop(pid, None)
        self._first.pop(pid, None)
        peak = self._peak.pop(pid, None)
        if completed and peak is not None:
            self._ended_peaks += peak
            self.num_ended += 1

    def _expected_peak(self, pid: str | None) -> int:
        if self.num_ended:
            return -(-self._ended_peaks // self.num_ended)
        firsts = [self._first[pid]] if pid is not None else list(self._first.values())
        return int(self.cold_growth * max(firsts)) if firsts else 0

    def _reserved(self, pid: str) -> int:
        return max(self._need[pid], self._expected_peak(pid))
