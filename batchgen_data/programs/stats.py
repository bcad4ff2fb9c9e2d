"""What a program run reused: prompt tokens and prefix-cache hits per step index.

A program's first step has nothing to reuse; every later step repeats the conversation so far,
so its prompt should mostly be prefix hits (pinned KV, core/pins.py). These counters show
whether it was (`by_step`), next to the engine's pin counters (`pins`), so a benchmark or a test
can tell reuse from recompute without timing anything.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepCounts:
    steps: int = 0  # generations run at this step index
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of those, reused from the prefix cache

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class ProgramStats:
    by_step: dict[int, StepCounts] = field(default_factory=dict)  # step index (1-based) ->
    programs_started: int = 0
    max_in_flight: int = 0

    def record(self, step: int, prompt_tokens: int, cached_tokens: int) -> None:
        c = self.by_step.setdefault(step, StepCounts())
        c.steps += 1
        c.prompt_tokens += prompt_tokens
        c.cached_tokens += cached_tokens

    def summary(self, pins: Any = None) -> dict[str, Any]:
        """Plain numbers for a report; `pins`: the engine's `PrefixPins`, whose counters join."""
        out: dict[str, Any] = {
            "programs_started": self.programs_started, "max_in_flight": self.max_in_flight,
            "by_step": {k: {"steps": c.steps, "prompt_tokens": c.prompt_tokens,
                            "cached_tokens": c.cached_tokens, "hit_rate": round(c.hit_rate, 3)}
                        for k, c in sorted(self.by_step.items())}}
        if pins is not None:
            out["pins"] = {"pinned": pins.num_pinned, "refused": pins.num_refused,
                           "dropped": pins.num_dropped, "dropped_blocks": pins.num_dropped_blocks}
        return out
