"""Per-request sampling parameters, with vLLM's field names and semantics.

Validation happens at construction so that a bad value is reported at the public entry point,
naming the field, before any work is scheduled.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check()

    def _check(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        for name in ("n", "top_k", "min_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"SamplingParams.{name} must be an int, got {type(v).__name__}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise TypeError(f"SamplingParams.{name} must be a number, got {type(v).__name__}")
        if self.n < 1:
            raise bad("n", "must be >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (disabled) or a positive int")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None:
            if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
                raise TypeError("SamplingParams.max_tokens must be an int or None")
            if self.max_tokens < 1:
                raise bad("max_tokens", "must be >= 1")
            if self.min_tokens > self.max_tokens:
                raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError("SamplingParams.seed must be an int or None")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be None or an int >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative ints")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | "SamplingParams" | None) -> "SamplingParams":
        """Build from a plain dict (Ray/Spark configs); unknown keys raise TypeError naming them."""
        if d is None:
            return cls()
        if isinstance(d, SamplingParams):
            return d
        if not isinstance(d, dict):
            raise TypeError(f"sampling_params must be a dict or SamplingParams, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise TypeError(f"unknown sampling parameter(s) {unknown}; valid: {sorted(known)}")
        return cls(**d)

    def merged(self, overrides: dict[str, Any] | None) -> "SamplingParams":
        """A copy with per-row overrides applied (validated like a fresh object)."""
        if not overrides:
            return self
        base = self.to_dict()
        base.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams.from_dict(base)
