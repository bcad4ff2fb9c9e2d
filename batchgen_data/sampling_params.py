"""Per-request sampling parameters, with vLLM's field names and semantics.

Validation happens at construction so that a bad value is reported at the public entry point,
naming the field, before any work is scheduled. Checks that need the model (token ids inside the
vocabulary, bad words that tokenise to something) run when the engine accepts the request.

Fields of vLLM's `SamplingParams` that are not here raise: `TypeError` for an unknown keyword,
and `from_dict` (connectors, configs) names the unsupported ones in `UNSUPPORTED`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from batchgen_data.structured.params import StructuredOutputsParams

# vLLM fields this engine does not implement, and why (shown by `from_dict`)
UNSUPPORTED = {
    "guided_decoding": "renamed structured_outputs in vLLM; use structured_outputs",
    "logits_processors": "per-request logits processors are not supported (vLLM v1 removed them)",
    "output_kind": "outputs are always returned once, when the request finishes",
    "spaces_between_special_tokens": "the fast tokenizers used here do not implement it",
    "use_beam_search": "beam search is not supported",
    "logprob_token_ids": "not supported; use logprobs",
    "prompt_logprob_token_ids": "not supported; use prompt_logprobs",
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

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids"):  # list() below would hide what was given
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, list, tuple)):
                raise TypeError(f"SamplingParams.{name} must be a list, got "
                                f"{type(v).__name__}: {v!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None:
            self.bad_words = list(dict.fromkeys(self.bad_words))
        if self.logit_bias is not None:
            self.logit_bias = _bias_dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.structured_outputs = _structured(self.structured_outputs)
        self._check()
        self._check_new_fields()
        # whether the sampler must mask or bias this request's logits (see `SamplingBatch`):
        # read for every row of every step, so derived once here; change these fields by
        # building a new object (`dataclasses.replace`), not by assignment
        self.edits_logits = bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    def _bad(self, name: str, why: str) -> ValueError:
        return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

    def _check(self) -> None:
        bad = self._bad
        for name in ("n", "top_k", "min_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"SamplingParams.{name} must be an int, got "
                                f"{type(v).__name__}: {v!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise TypeError(f"SamplingParams.{name} must be a number, got "
                                f"{type(v).__name__}: {v!r}")
            if math.isnan(v):  # NaN passes every range check below
                raise bad(name, "must be a number, not NaN")
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
                raise TypeError(f"SamplingParams.max_tokens must be an int or None, got "
                                f"{type(self.max_tokens).__name__}: {self.max_tokens!r}")
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
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise bad(name, "must be None or an int >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative ints")

    def _check_new_fields(self) -> None:
        bad = self._bad
        if self.structured_outputs is not None:
            self._check_structured()
        if self.best_of is not None and self.best_of != self.n:
            raise bad("best_of", f"not supported (vLLM v1 removed it): leave it unset or equal "
                                 f"to n ({self.n}); to get {self.best_of} samples use n")
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", "must be a bool")
        if self.stop and not self.detokenize:
            raise bad("detokenize", "stop strings need detokenize=True")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or (t < 1 and t != -1)):
            raise bad("truncate_prompt_tokens", "must be None, -1 or an int >= 1")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must not be empty (None allows every token)")
            if any(not _is_int(x) or x < 0 for x in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be non-negative ints")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip()
                                              for w in self.bad_words):
            raise bad("bad_words", "must be non-empty strings")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "must be a dict or None")

    def _check_structured(self) -> None:
        # each of these would fight the grammar's own allow-list, and where the grammar allows
        # only EOS (its end) they would leave no token to draw
        clash = [name for name, on in (("ignore_eos", self.ignore_eos),
                                       ("min_tokens", self.min_tokens > 0),
                                       ("allowed_token_ids", self.allowed_token_ids is not None),
                                       ("bad_words", bool(self.bad_words))) if on]
        if clash:
            raise self._bad(clash[0], "cannot be combined with structured_outputs: the grammar "
                                      "decides which tokens may come and when the output ends")

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the field when a token id is outside the model's vocabulary.

        (stop_token_ids are not checked: an id the model cannot produce just never stops it.)
        """
        for name, ids in (("allowed_token_ids", self.allowed_token_ids or ()),
                          ("logit_bias", self.logit_bias or ())):
            out = sorted(t for t in ids if t >= vocab_size)
            if out:
                raise ValueError(f"SamplingParams.{name}: token id(s) {out[:5]} are outside "
                                 f"the model's vocabulary [0, {vocab_size})")

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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bias_dict(value: Any) -> dict[int, float]:
    """{token id: bias} from a dict (int or numeric-string keys, as JSON gives) or from a list
    of (id, bias) pairs (how an Arrow map column reads back); biases clamped to [-100, 100].
    A null bias is no bias: an Arrow struct column fills the keys a row lacks with nulls."""
    pairs = value.items() if isinstance(value, Mapping) else value
    out: dict[int, float] = {}
    try:
        for key, bias in pairs:
            if bias is None:
                continue
            tok = int(key) if isinstance(key, str) else key
            if not _is_int(tok) or tok < 0:
                raise ValueError(f"key {key!r} is not a token id")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
                raise ValueError(f"bias {bias!r} for token {key!r} is not a number")
            out[tok] = min(100.0, max(-100.0, float(bias)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"SamplingParams.logit_bias={value!r}: must map token ids (ints) to "
                         f"numbers ({e})") from None
    return out
