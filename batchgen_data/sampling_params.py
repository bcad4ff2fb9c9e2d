"""Per-request sampling parameters, with vLLM's field names and semantics.

Validation happens at construction so that a bad value is reported at the public entry point,
naming the field, before any work is scheduled. Checks that need the model (token ids inside the
vocabulary, bad words that tokenise to something) run when the engine accepts the request.

Fields of vLLM's `SamplingParams` that are not here raise: `TypeError` for an unknown keyword,
and `from_dict` (connectors, configs) names the unsupported ones in `UNSUPPORTED`.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, fields
from typing import Any

from batchgen_data.sampling_checks import (ParamTypeError, bias_dict, check_core, check_fields,
                                           coerce)
from batchgen_data.structured import StructuredOutputsParams

# vLLM fields this engine does not implement, and why (shown by `from_dict`)
UNSUPPORTED = {
    "guided_decoding": "renamed structured_outputs in vLLM; use structured_outputs",
    "logits_processors": "per-request logits processors are not supported (vLLM v1 removed them)",
    "output_kind": "outputs are always returned once, when the request finishes",
    "spaces_between_special_tokens": "the fast tokenizers used here do not implement it",
    "use_beam_search": "beam search is not supported",
    "logprob_token_ids": "not supported; use logprobs",
    "prompt_logprob_token_ids": "not supported; use prompt_logprobs",
    "prompt_logprob_start": "not supported; prompt_logprobs score every prompt token",
    "flat_logprobs": "logprobs are returned as vLLM's default list of dicts",
    "stream_interval": "outputs are always returned once, when the request finishes",
    "repetition_detection": "not supported; use repetition_penalty or max_tokens",
}


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
    # fields added after the first release go below, so positional arguments keep their meaning
    prompt_logprobs: int | None = None  # per prompt token: its logprob and the top-k (raw logits)
    # added to the raw logits before sampling; clamped to [-100, 100] as vLLM does
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (tokenised by the engine)
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: all that fit
    detokenize: bool = True
    best_of: int | None = None  # vLLM v1 removed it: only None or n are accepted
    extra_args: dict[str, Any] | None = None  # carried with the request, unused (as in vLLM)
    # a StructuredOutputsParams, or a dict with its fields (json, regex, choice, grammar,
    # json_object): the output is constrained to it (docs/structured-output.md)
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's name: at most this many reasoning tokens, then the end of thinking is appended
    # and the row answers (needs the engine's reasoning_parser; -1 or None: no budget;
    # docs/reasoning.md)
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        coerce(self)
        for name in ("stop", "stop_token_ids", "bad_words"):  # list() would hide what was given
            v = getattr(self, name)
            if v is not None and not isinstance(v, (list, tuple)) and \
                    not (isinstance(v, str) and name != "stop_token_ids"):
                raise ParamTypeError(f"SamplingParams.{name} must be a list, got "
                                     f"{type(v).__name__}: {v!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.logit_bias is not None:
            self.logit_bias = bias_dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.structured_outputs = _structured(self.structured_outputs)
        self.thinking_token_budget = _budget(self.thinking_token_budget)
        check_core(self)
        check_fields(self)
        # whether the sampler must mask or bias this request's logits (see `SamplingBatch`):
        # read for every row of every step, so derived once here; change these fields by
        # building a new object (`dataclasses.replace`), not by assignment
        self.edits_logits = bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the field when a token id is outside the model's vocabulary
        (vLLM's words: the ids index the logits' columns)."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", self.logit_bias or ())):
            out = sorted(t for t in ids if t >= vocab_size)
            if out:
                raise ValueError(f"SamplingParams.{name}: token_id(s) {out[:5]} in {name} "
                                 f"contain out-of-vocab token ids. Vocabulary size: "
                                 f"{vocab_size}")
        if any(t >= vocab_size for t in self.allowed_token_ids or ()):
            raise ValueError(f"SamplingParams.allowed_token_ids contains out-of-vocab token "
                             f"id! Vocabulary size: {vocab_size}")

    def truncated_prompt(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt after `truncate_prompt_tokens`: its last k tokens (left truncation).

        -1 keeps as many as fit with room for one output token (max_model_len - 1).
        """
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        k = max_model_len - 1 if k == -1 else k
        return list(prompt_token_ids[-k:]) if len(prompt_token_ids) > k else prompt_token_ids

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's `clone`)."""
        return copy.deepcopy(self)

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
        unsupported = sorted(set(d) & set(UNSUPPORTED))
        if unsupported:
            raise ValueError("unsupported sampling parameter(s): " + "; ".join(
                f"{k} ({UNSUPPORTED[k]})" for k in unsupported))
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


def _structured(value: Any) -> StructuredOutputsParams | None:
    try:
        return StructuredOutputsParams.from_value(value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"SamplingParams.{e}" if str(e).startswith("structured_outputs")
                      else f"SamplingParams.structured_outputs: {e}") from None


def _budget(value: Any) -> int | None:
    """`thinking_token_budget` as vLLM takes it: an int >= 0, or -1 / None for none."""
    if value is None or (value == -1 and not isinstance(value, bool)):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ParamTypeError(f"SamplingParams.thinking_token_budget must be a non-negative "
                             f"integer or -1 for unlimited, got {value!r}")
    return value
