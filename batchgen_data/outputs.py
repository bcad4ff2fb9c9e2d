"""Results handed back to users: vLLM-shaped RequestOutput / CompletionOutput.

Logprobs are vLLM's: per position a dict token id -> `Logprob` (batchgen_data/logprobs.py).
`RequestOutput.metrics` is None, as vLLM's offline `LLM` leaves it (it fills it only when
statistics are logged); this engine's counters are `engine.stats` (docs/ENGINE_API.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchgen_data.logprobs import Logprob

SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | "tool_calls"
    # with SamplingParams.logprobs: one dict per generated token, the sampled token plus the
    # top-n, each a Logprob(logprob, rank, decoded_token)
    logprobs: SampleLogprobs | None = None
    stop_reason: int | str | None = None
    # fields added after the first release go below, so positional arguments keep their meaning
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (with logprobs)
    lora_request: Any = None  # the LoRARequest it ran under
    # with the engine's reasoning_parser (docs/reasoning.md): `text` is the answer alone and
    # this the reasoning (None: the row did not think); vLLM's offline outputs have no such
    # field, its server's message calls it `reasoning`
    reasoning_text: str | None = None
    num_reasoning_tokens: int | None = None  # output tokens of the reasoning (with a parser)
    # with the engine's tool_call_parser: the calls in the answer, OpenAI's shape ({"id",
    # "type": "function", "function": {"name", "arguments"}}), finish_reason "tool_calls";
    # a call that could not be read is said here and the answer stays text
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_error: str | None = None

    def finished(self) -> bool:
        """Whether this sample ended (a method, as in vLLM; `RequestOutput.finished` is a bool)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: one dict per prompt token (the prompt token plus the
    # top-k, each a Logprob); the first entry is None, since nothing predicts that token
    prompt_logprobs: PromptLogprobs | None = None
    metrics: Any = None  # vLLM's RequestStateStats; None, as vLLM's offline LLM gives
    lora_request: Any = None  # the LoRARequest it ran under
