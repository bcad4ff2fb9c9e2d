"""One generated sequence: tokens, KV accounting and status.

There is a single token-accounting model: `num_computed_tokens` catches up with `num_tokens`.
A fresh prompt, a chunked prefill, a decode step and a recompute after preemption are all the
same thing to the scheduler: "this sequence needs `num_tokens - num_computed_tokens` tokens".
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from batchgen_data.core.thinking import ThinkingBudget
from batchgen_data.core.multimodal import MultiModalPrompt
from batchgen_data.logprobs import RawLogprobs
from batchgen_data.lora_request import LoRARequest
from batchgen_data.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    """Ordered so that `status >= FINISHED_STOPPED` means finished."""

    WAITING = 0
    HELD = 1
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # a step failed for its request alone (engine/step_failure.py)

    @property
    def finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort", 6: "error"}.get(int(self))


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # position among the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # effective sampling seed: the user's, or one drawn by the engine at submit
    max_tokens: int  # params.max_tokens clipped to max_model_len
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    block_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: int | str | None = None
    # per output token (plain data, batchgen_data/logprobs.py): the sampled id and its top-k
    logprobs: list[RawLogprobs] | None = None
    # prompt_logprobs, collected by the request's first sequence only (see engine/prompt_logprobs)
    prompt_logprobs: list[RawLogprobs | None] | None = None
    text: str = ""
    # KV kept in host memory while held: (k, v) per layer, each [num_computed_tokens, Hkv, D]
    held_kv: Any = None
    # prefix-cache chain: hashes of this sequence's full, registered blocks
    block_hashes: list[int] = field(default_factory=list)
    lora: LoRARequest | None = None  # the adapter it runs under (None: the base model)
    alone: bool = False  # runs in steps with no other request's sequences (Engine.submit)
    # its prompt's images (core/multimodal.py; shared by the request's samples), and whether
    # it holds their encoder outputs in the engine's cache (core/encoder_cache.py)
    mm: MultiModalPrompt | None = None
    mm_held: bool = False
    # its prompt's prefix keys (placement/prefix.py), computed once when a placement policy
    # first asks (core/queue_report.py)
    prefix_keys: tuple[int, ...] | None = None
    # its thinking budget while it reasons under one (core/thinking.py), else None
    thinking: ThinkingBudget | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        collects = self.params.prompt_logprobs is not None and self.index == 0
        if collects and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is still to compute before the next sample."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def cache_root(self) -> int | None:
        """Where its prefix-cache chain starts: KV computed under an adapter is another KV,
        so each adapter has its own chain (None: the base model's)."""
        return None if self.lora is None else hash(("lora", self.lora.lora_int_id))

    def remaining_tokens_estimate(self) -> int:
        return self.num_pending_tokens + self.max_tokens - self.num_output_tokens

    def to_state(self) -> dict[str, Any]:
        """Plain, picklable data: everything another engine needs to continue this sequence."""
        return {
            "request_id": self.request_id,
            "index": self.index,
            "prompt_token_ids": list(self.prompt_token_ids),
            "output_token_ids": self.output_token_ids,
            "params": self.params.to_dict(),
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "lora": None if self.lora is None else self.lora.to_dict(),
        }


def collecting(seq: Sequence) -> bool:
    """Whether `seq` still has prompt positions whose logprobs are missing."""
    return seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens


def cacheable_tokens(seq: Sequence) -> int:
    """How many leading tokens of `seq` the prefix cache may supply."""
    limit = seq.num_tokens - 1  # the last token is always computed: its logits are sampled
    if collecting(seq):
        # position p gives entry p + 1: only positions whose entry exists may come from cache
        limit = min(limit, len(seq.prompt_logprobs) - 1)
    return limit
