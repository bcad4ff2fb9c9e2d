"""Results handed back to users: vLLM-shaped RequestOutput / CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"
    # one dict per generated token: {token_id: logprob} (sampled token plus the top-n)
    logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: one dict per prompt token, {token_id: logprob} (the
    # prompt token plus the top-k); the first entry is None, since nothing predicts that token
    prompt_logprobs: list[dict[int, float] | None] | None = None
