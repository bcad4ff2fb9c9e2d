"""A row's thinking budget: past it, the end of thinking is written for the model.

When a sequence's reasoning reaches `SamplingParams.thinking_token_budget` tokens, the family's
end-of-thinking text (the parser's `end_ids`: Qwen's sentence and `</think>` unless the engine's
`reasoning_end_str` says otherwise) is appended to its tokens right after the token that
reached the budget. That is all the event does: the sequence keeps its KV blocks and its place
among the running ones, and since its tokens now run ahead of its computed ones, the scheduler
gives it those appended tokens to compute in its next step, as it would a prompt's (one token
accounting, core/sequence.py), after which it samples its answer. No stop, no new request.

A job may also cap every row adaptively (`ThinkingCap`, the engine's `thinking_cap_quantile`):
no row reasons longer than a quantile of the job's reasoning lengths, estimated from the rows
that ended their reasoning so far and those still reasoning (`censored_quantile`). The same
event ends a row at the lower of the two.

The budget's state is a function of the sequence's tokens, so an exported sequence needs none
of it: the importing engine replays the tokens (`ThinkingBudget.attach`; a job cap is the
importing engine's own). The appended tokens count as reasoning tokens of the output; they
have no logprobs, so a budget refuses `logprobs` and the job cap leaves such rows alone.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from batchgen_data.reasoning.think import ThinkParser


@dataclass(eq=False)
class ThinkingCap:
    """A job's adaptive reasoning cap: the `quantile` of the job's reasoning lengths, once
    `min_rows` rows have ended their reasoning themselves (None before, or while the rows seen
    cannot yet tell where that quantile lies).

    The rows that end first are the short ones, so the quantile of the finished rows alone
    would sit near the short rows' and cut most long thinkers. The rows still thinking, and
    those cut by a budget or the cap, are instead counted as reasoning *at least* as long as
    they have so far (right-censored), and the quantile is read from the product-limit
    (Kaplan-Meier) estimate of the lengths: the smallest length L with an estimated share of
    rows reasoning longer than L of at most 1 - `quantile`."""

    quantile: float
    min_rows: int = 16
    ended_lengths: list[int] = field(default_factory=list)  # sorted: rows that ended themselves
    cut_lengths: list[int] = field(default_factory=list)  # rows cut, at their cut
    live: set[Any] = field(default_factory=set)  # the budgets still thinking
    value: int | None = None
    _estimated_at: int = 0  # len(ended_lengths) at the last estimate

    def watch(self, budget: Any) -> None:
        self.live.add(budget)

    def ended(self, budget: Any) -> None:
        """`budget`'s row ended its reasoning by itself after `budget.used` tokens."""
        self.live.discard(budget)
        bisect.insort(self.ended_lengths, budget.used)
        n = len(self.ended_lengths)
        # the estimate costs a sort of every row seen: redone as the count grows by 1/64
        if n >= self.min_rows and n - self._estimated_at >= max(1, self._estimated_at // 64):
            self._estimated_at = n
            self.value = censored_quantile(self.ended_lengths, self.cut_lengths
                                           + [b.used for b in self.live], self.quantile)

    def cut(self, budget: Any) -> None:
        """`budget`'s row was cut after `budget.used` tokens (it would have gone on)."""
        self.live.discard(budget)
        self.cut_lengths.append(budget.used)


def censored_quantile(ended: list[int], at_least: list[int], quantile: float) -> int | None:
    """The `quantile` of a length from the product-limit estimate: `ended` are exact lengths
    (sorted), `at_least` lower bounds of the others. None while the estimated share above
    every ended length is still over 1 - `quantile`."""
    bounds = sorted(at_least)
    share = 1.0
    i = 0
    while i < len(ended):
        length = ended[i]
        j = bisect.bisect_right(ended, length, lo=i)
        # rows still in the running at `length`: ended there or later, or known to go on
        at_risk = (len(ended) - i) + (len(bounds) - bisect.bisect_left(bounds, length))
        share *= 1.0 - (j - i) / at_risk
        if share <= 1.0 - quantile + 1e-12:
            return length
        i = j
    return None


@dataclass(eq=False, slots=True)
class ThinkingBudget:
    budget: int | None  # reasoning tokens this row may use (None: the job cap alone)
    cap: ThinkingCap | None  # the job's adaptive cap, if any
    start_id: int
    end_id: int
    end_ids: tuple[int, ...]  # appended when the budget is reached
    thinking: bool  # inside the reasoning now
    used: int = 0  # reasoning tokens so far

    @classmethod
    def attach(cls, seq: Any, parser: ThinkParser, cap: ThinkingCap | None = None) -> None:
        """Watch `seq` under its params' budget and the job's cap: replays its output so far
        (an imported sequence), and appends the end at once if it is already spent (0 tokens
        allowed, a prompt that opens the reasoning). A sequence past its reasoning, or under
        neither limit, is left unwatched."""
        budget = seq.params.thinking_token_budget
        if budget is None and (cap is None or seq.params.logprobs is not None):
            return
        b = cls(budget, cap, parser.start_id, parser.end_id, tuple(parser.end_ids),
                parser.prompt_thinking(seq.prompt_token_ids) is not False)
        for t in seq.token_ids[len(seq.prompt_token_ids):]:
            if not b._count(t):
                return
        if cap is not None:
            cap.watch(b)
        if b._spent():
            b._cut(seq)
        else:
            seq.thinking = b

    def _count(self, token: int) -> bool:
        """Count one output token; False once the reasoning has ended."""
        if token == self.start_id:
            self.thinking, self.used = True, 0  # what came before the tag is not reasoning
        elif token == self.end_id and self.thinking:
            return False
        elif self.thinking:
            self.used += 1
        return True

    def _spent(self) -> bool:
        if not self.thinking:
            return False
        if self.budget is not None and self.used >= self.budget:
            return True
        cap = self.cap
        return cap is not None and cap.value is not None and self.used >= cap.value

    def saw(self, seq: Any, token: int) -> None:
        """After `seq` sampled `token` and goes on: count it; at the limit, append the end."""
        if not self._count(token):
            seq.thinking = None  # the model ended its reasoning itself
            if self.cap is not None:
                self.cap.ended(self)
        elif self._spent():
            self._cut(seq)

    def _cut(self, seq: Any) -> None:
        """Append the end of thinking where it fits with room for one answer token; where
        it does not, the row runs into max_tokens still thinking (finish_reason "length",
        its reasoning kept). Either way nothing more is watched."""
        n_out = len(seq.token_ids) - len(seq.prompt_token_ids)
        if n_out + len(self.end_ids) < seq.max_tokens:
            seq.token_ids.extend(self.end_ids)
        seq.thinking = None
        if self.cap is not None:
            self.cap.cut(self)


def check_budget(params: Any, parser: ThinkParser | None, async_scheduling: bool) -> None:
    """ValueError naming the field unless this engine can keep `params`' thinking budget:
    it needs the parser that knows where reasoning ends, steps run one at a time (an
    overlapped step is scheduled before the tokens it would append), and no logprobs (the
    appended tokens were not sampled)."""
    if params.thinking_token_budget is None:
        return
    if parser is None:
        raise ValueError("SamplingParams.thinking_token_budget needs the engine's "
                         "reasoning_parser (docs/reasoning.md)")
    if async_scheduling:
        raise ValueError("SamplingParams.thinking_token_budget is not supported with "
                         "async_scheduling=True")
    if params.logprobs is not None:
        raise ValueError("SamplingParams.thinking_token_budget with logprobs is not "
                         "supported: the appended end of thinking has no logprobs")


def job_cap(quantile: float | None, parser: ThinkParser | None,
            async_scheduling: bool) -> ThinkingCap | None:
    """The engine's adaptive cap (`thinking_cap_quantile`), or None; ValueError when the
    engine cannot keep one."""
    if quantile is None:
        return None
    if parser is None or async_scheduling:
        raise ValueError(f"thinking_cap_quantile={quantile!r} needs a reasoning_parser and "
                         "async_scheduling=False (docs/reasoning.md)")
    return ThinkingCap(quantile)
