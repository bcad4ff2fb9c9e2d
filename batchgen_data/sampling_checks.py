"""The checks of `SamplingParams` at construction, with vLLM's rules and words.

Each message is vLLM's own (so a caller's match on vLLM's text still matches) behind
`SamplingParams.`, which names the field. A value of the wrong type raises `ParamTypeError`,
both a TypeError and a ValueError. The checks that need the model (token ids inside the
vocabulary, bad words that tokenise) run when the engine accepts the request
(`SamplingParams.check_vocab`, the sampler's).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

_log = logging.getLogger(__name__)

# vLLM's bounds: a temperature above 0 is raised to at least this (below it the softmax of
# raw logits overflows), and none above MAX_TEMPERATURE is accepted (OpenAI's range too)
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0


class ParamTypeError(TypeError, ValueError):
    """A sampling field of the wrong type. A TypeError by Python's convention and a ValueError
    by vLLM's (its validation error for `n=1.5` or `stop_token_ids="abc"`), so either `except`
    catches it."""


def coerce(sp: Any) -> None:
    """vLLM's spellings of a value, turned into the value: seed=-1 is no seed,
    logprobs=True one top logprob (False zero), and a temperature above 0 but below
    `MIN_TEMPERATURE` is raised to it (lower ones overflow the softmax)."""
    if sp.seed == -1 and is_int(sp.seed):
        sp.seed = None
    for name in ("logprobs", "prompt_logprobs"):
        if isinstance(getattr(sp, name), bool):
            setattr(sp, name, int(getattr(sp, name)))
    t = sp.temperature
    if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < MIN_TEMPERATURE:
        _log.warning("SamplingParams.temperature=%s is below %s, which overflows the "
                     "softmax; using %s", t, MIN_TEMPERATURE, MIN_TEMPERATURE)
        sp.temperature = MIN_TEMPERATURE


def bad(name: str, why: str) -> ValueError:
    """vLLM's message (`why`, which starts with the field's name where vLLM's does) behind
    `SamplingParams.`, so a caller's match on vLLM's words still matches."""
    return ValueError(f"SamplingParams.{why}" if why.startswith(name)
                      else f"SamplingParams.{name}: {why}")


def check_core(sp: Any) -> None:
    """The fields vLLM checks in `SamplingParams._verify_args`, in its order."""
    if not is_int(sp.n):
        raise ParamTypeError(f"SamplingParams.n must be an int, but is of type "
                             f"{type(sp.n).__name__}: {sp.n!r}")
    for name in ("top_k", "min_tokens"):
        v = getattr(sp, name)
        if not is_int(v):
            raise ParamTypeError(f"SamplingParams.{name} must be an int, got "
                                 f"{type(v).__name__}: {v!r}")
    for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty"):
        v = getattr(sp, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ParamTypeError(f"SamplingParams.{name} must be a number, got "
                                 f"{type(v).__name__}: {v!r}")
        if not math.isfinite(v):  # NaN passes every range check below, inf some
            raise bad(name, f"{name} must be a finite number, got {v}.")
    if sp.n < 1:
        raise bad("n", f"n must be at least 1, got {sp.n}.")
    if not -2 <= sp.presence_penalty <= 2:
        raise bad("presence_penalty", f"presence_penalty must be in [-2, 2], got "
                                      f"{sp.presence_penalty}.")
    if not -2 <= sp.frequency_penalty <= 2:
        raise bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got "
                                       f"{sp.frequency_penalty}.")
    if sp.repetition_penalty <= 0:
        raise bad("repetition_penalty", f"repetition_penalty must be greater than zero, "
                                        f"got {sp.repetition_penalty}.")
    if sp.temperature < 0:
        raise bad("temperature", f"temperature must be non-negative, got "
                                 f"{sp.temperature}.")
    if sp.temperature > MAX_TEMPERATURE:
        raise bad("temperature", f"temperature must be in [0, {MAX_TEMPERATURE:g}], got "
                                 f"{sp.temperature}.")
    if not 0 < sp.top_p <= 1:
        raise bad("top_p", f"top_p must be in (0, 1], got {sp.top_p}.")
    if sp.top_k < -1:
        raise bad("top_k", f"top_k must be 0 (disable), or at least 1, got {sp.top_k}.")
    if not 0 <= sp.min_p <= 1:
        raise bad("min_p", f"min_p must be in [0, 1], got {sp.min_p}.")
    if sp.max_tokens is not None:
        if not is_int(sp.max_tokens):
            raise ParamTypeError(f"SamplingParams.max_tokens must be an int or None, got "
                                 f"{type(sp.max_tokens).__name__}: {sp.max_tokens!r}")
        if sp.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be at least 1, got "
                                    f"{sp.max_tokens}.")
    if sp.min_tokens < 0:
        raise bad("min_tokens", f"min_tokens must be greater than or equal to 0, got "
                                f"{sp.min_tokens}.")
    if sp.max_tokens is not None and sp.min_tokens > sp.max_tokens:
        raise bad("min_tokens", f"min_tokens must be less than or equal to "
                                f"max_tokens={sp.max_tokens}, got {sp.min_tokens}.")
    if sp.seed is not None and not is_int(sp.seed):
        raise ParamTypeError(f"SamplingParams.seed must be an int or None, got "
                             f"{type(sp.seed).__name__}: {sp.seed!r}")
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(sp, name)
        if v is not None and (not is_int(v) or v < -1):  # -1: the whole vocabulary
            raise bad(name, f"{name} must be non-negative or -1, got {v!r}.")
    if any(not is_int(t) for t in sp.stop_token_ids):
        raise bad("stop_token_ids", f"stop_token_ids must contain only integers, got "
                                    f"{sp.stop_token_ids}.")
    if any(t < 0 for t in sp.stop_token_ids):
        raise bad("stop_token_ids", f"stop_token_ids must be token ids (>= 0), got "
                                    f"{sp.stop_token_ids}.")
    if any(not isinstance(s, str) for s in sp.stop):
        raise bad("stop", f"stop must contain only strings, got {sp.stop}.")
    if any(not s for s in sp.stop):
        raise bad("stop", "stop cannot contain an empty string.")
    if sp.greedy and sp.n > 1:
        raise bad("n", f"n must be 1 when using greedy sampling, got {sp.n}.")
    sp.stop_token_ids = list(dict.fromkeys(sp.stop_token_ids))  # checked hashable


def check_fields(sp: Any) -> None:
    """The fields vLLM checks elsewhere (at the request) or not at all, and this engine's own
    limits on them."""
    if sp.structured_outputs is not None:
        _check_structured(sp)
    if sp.best_of is not None and sp.best_of != sp.n:
        raise bad("best_of", f"best_of={sp.best_of!r} is not supported (vLLM v1 removed "
                             f"it): leave it unset or equal to n ({sp.n}); to get "
                             f"{sp.best_of} samples use n")
    if not isinstance(sp.detokenize, bool):
        raise bad("detokenize", f"detokenize must be a bool, got {sp.detokenize!r}.")
    if sp.stop and not sp.detokenize:
        raise bad("detokenize", "stop strings are only supported when detokenize is True. "
                                "Set detokenize=True to use stop.")
    t = sp.truncate_prompt_tokens
    if t is not None and (not is_int(t) or (t < 1 and t != -1)):
        raise bad("truncate_prompt_tokens", f"truncate_prompt_tokens must be None, -1 or "
                                            f"an int >= 1, got {t!r}.")
    if sp.allowed_token_ids is not None:
        if not sp.allowed_token_ids:
            raise bad("allowed_token_ids", "allowed_token_ids is not None and empty! "
                                           "(None allows every token)")
        if any(not is_int(x) or x < 0 for x in sp.allowed_token_ids):
            raise bad("allowed_token_ids", f"allowed_token_ids must contain only token ids "
                                           f"(ints >= 0), got {sp.allowed_token_ids}.")
    if sp.bad_words is not None:
        if any(not isinstance(w, str) for w in sp.bad_words):
            raise bad("bad_words", f"bad_words must contain only strings, got "
                                   f"{sp.bad_words}.")
        if any(not w.strip() for w in sp.bad_words):  # nothing to tokenise, nothing to ban
            raise bad("bad_words", f"bad_words cannot contain an empty string. Got "
                                   f"bad_words={sp.bad_words}")
        sp.bad_words = list(dict.fromkeys(sp.bad_words))
    if sp.extra_args is not None and not isinstance(sp.extra_args, dict):
        raise bad("extra_args", f"extra_args must be a dict or None, got "
                                f"{type(sp.extra_args).__name__}.")


def _check_structured(sp: Any) -> None:
    # each of these would fight the grammar's own allow-list, and where the grammar allows
    # only EOS (its end) they would leave no token to draw
    clash = [name for name, on in (("ignore_eos", sp.ignore_eos),
                                   ("min_tokens", sp.min_tokens > 0),
                                   ("allowed_token_ids", sp.allowed_token_ids is not None),
                                   ("bad_words", bool(sp.bad_words))) if on]
    if clash:
        raise bad(clash[0], "cannot be combined with structured_outputs: the grammar "
                            "decides which tokens may come and when the output ends")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def bias_dict(value: Any) -> dict[int, float]:
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
            if not is_int(tok) or tok < 0:
                raise ValueError(f"key {key!r} is not a token id")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
                raise ValueError(f"bias {bias!r} for token {key!r} is not a number")
            out[tok] = min(100.0, max(-100.0, float(bias)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"SamplingParams.logit_bias={value!r}: must map token ids (ints) to "
                         f"numbers ({e})") from None
    return out
