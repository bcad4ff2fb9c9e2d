"""Checks on one prompt, shared by `LLM.generate` and the connectors so they say the same thing.

A bad prompt raises ValueError (TypeError for a value of the wrong type) whose message names the
field and shows the value; the connectors turn it into the row's `error` value, `LLM.generate`
raises it with the prompt's index in front (`prompts[3]: prompt is null`). Where vLLM refuses
the same input, the message carries vLLM's words too ("The decoder prompt cannot be empty",
"out of vocabulary", "longer than the maximum model length"), so a caller that matches on them
keeps working. The catalogue of bad input and the messages it gets is docs/row-errors.md.
"""
from __future__ import annotations

from typing import Any

_SHOWN = 60  # characters of a bad value quoted in a message: enough to find the row


def shown(value: Any) -> str:
    """repr of a bad value, cut short: a message names the value, not a whole document."""
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "..."


def check_prompt_text(value: Any) -> str:
    """`value` itself when it is a prompt the engine can take; ValueError/TypeError otherwise."""
    if value is None:
        raise ValueError("prompt is null")
    if not isinstance(value, str):
        raise TypeError(f"prompt must be a string, got {type(value).__name__}: {shown(value)}")
    if not value:
        raise ValueError(EMPTY_PROMPT)
    if not value.strip():  # whitespace only is empty too here (vLLM runs it): nothing to say
        raise ValueError(f"prompt is empty (whitespace only): {shown(value)}")
    return value


EMPTY_PROMPT = "prompt is empty: The decoder prompt cannot be empty"


def too_long(num_tokens: int, max_model_len: int) -> str | None:
    """The message for a prompt of `num_tokens` that leaves no room for an output token under
    `max_model_len`, else None."""
    if num_tokens < max_model_len:
        return None
    extra = "" if num_tokens > max_model_len else \
        " plus the number of requested output tokens (at least 1)"
    return (f"prompt has {num_tokens} tokens: the decoder prompt (length {num_tokens}){extra} "
            f"is longer than the maximum model length of {max_model_len} (max_model_len)")


def first_bad_token(ids: Any, vocab_size: int | None = None) -> str | None:
    """The message for the first entry of `ids` that is not a token id, else None.

    Without `vocab_size` only the types are checked (a connector checks them before the
    engine does the range, so both say the same thing about a negative id).
    """
    if not isinstance(ids, (list, tuple)):
        return f"prompt_token_ids must be a list of ints, got {type(ids).__name__}: {shown(ids)}"
    if not ids:
        return "prompt_token_ids is empty: The decoder prompt cannot be empty"
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            return f"prompt_token_ids[{i}] is not an int: {shown(t)}"
    if vocab_size is None:
        return None
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            return (f"prompt_token_ids[{i}]={t}: Token id {t} is out of vocabulary "
                    f"[0, {vocab_size})")
    return None
