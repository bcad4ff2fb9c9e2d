"""OpenAI Batch output lines: a finished request as `chat.completion` / `text_completion`.

    {"id": "batch_req_…", "custom_id": "q1", "error": null,
     "response": {"status_code": 200, "request_id": "…", "body": {"object": "chat.completion", …}}}

A request that could not run has `response: null` and `error: {"code", "message"}`, as hosted
batch APIs write failed requests. Bodies carry only fields OpenAI's own client types declare,
so `openai.types.chat.ChatCompletion.model_validate(body)` accepts them, and with a reasoning
parser `message.reasoning_content` (DeepSeek's API's name for the reasoning, which OpenAI's
types keep as an extra field) beside `usage.completion_tokens_details.reasoning_tokens`.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# OpenAI's finish reasons; "abort" (a cancelled request) has no counterpart and reads as "stop"
_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}
# a logprob the engine did not report (JSON has no -Infinity); OpenAI uses the same floor
_FLOOR = -9999.0


@dataclass(frozen=True)
class Choice:
    """One sample of a finished request, as the engine (or a connector row) reports it."""

    text: str
    token_ids: Sequence[int]
    finish_reason: str | None
    logprobs: Sequence[dict[int, float]] | None = None  # per token: {token_id: logprob}
    num_top: int = 0  # top alternatives asked for (the dicts hold these plus the sampled one)
    # with the engine's reasoning_parser: the reasoning apart from `text` (the answer) and its
    # tokens (None: no parser; docs/reasoning.md)
    reasoning: str | None = None
    reasoning_tokens: int | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's shape (tool_call_parser)


def _ids() -> tuple[str, str]:
    hex_ = uuid.uuid4().hex
    return f"batch_req_{hex_[:24]}", f"req_{hex_[8:32]}"


def success_line(custom_id: str, chat: bool, model: str, choices: Sequence[Choice],
                 prompt_tokens: int, token_text: Callable[[int], str] | None = None
                 ) -> dict[str, Any]:
    """The output line of a finished request; `token_text` decodes one token for logprobs."""
    line_id, request_id = _ids()
    completion_tokens = sum(len(c.token_ids) for c in choices)
    body: dict[str, Any] = {
        "id": ("chatcmpl-" if chat else "cmpl-") + request_id[4:],
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": model,
        "choices": [(_chat_choice if chat else _text_choice)(i, c, token_text)
                    for i, c in enumerate(choices)],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }
    thought = [c.reasoning_tokens for c in choices if c.reasoning_tokens is not None]
    if thought:  # OpenAI's place for them (CompletionUsage.completion_tokens_details)
        body["usage"]["completion_tokens_details"] = {"reasoning_tokens": sum(thought)}
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body},
            "error": None}


def error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """The output line of a request that produced nothing."""
    return {"id": _ids()[0], "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _chat_choice(i: int, c: Choice, token_text: Callable[[int], str] | None) -> dict[str, Any]:
    logprobs = None
    if c.logprobs is not None and token_text is not None:
        logprobs = {"content": [_chat_token(tok, lps, c.num_top, token_text)
                                for tok, lps in zip(c.token_ids, c.logprobs)], "refusal": None}
    message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
    if c.reasoning is not None:  # DeepSeek's and vLLM's former name for it
        message["reasoning_content"] = c.reasoning
    if c.tool_calls:  # an answer of calls only has no content (OpenAI's shape)
        message["tool_calls"] = c.tool_calls
        message["content"] = c.text or None
    return {"index": i, "message": message,
            "logprobs": logprobs, "finish_reason": _FINISH.get(c.finish_reason or "", "stop")}


def _chat_token(tok: int, lps: dict[int, float], num_top: int,
                token_text: Callable[[int], str]) -> dict[str, Any]:
    def entry(t: int, lp: float) -> dict[str, Any]:
        text = token_text(t)
        return {"token": text, "logprob": float(lp), "bytes": list(text.encode("utf-8"))}

    top = sorted(lps.items(), key=lambda kv: -kv[1])[:num_top]
    return {**entry(tok, lps.get(tok, _FLOOR)),
            "top_logprobs": [entry(t, lp) for t, lp in top]}


def _text_choice(i: int, c: Choice, token_text: Callable[[int], str] | None) -> dict[str, Any]:
    logprobs = None
    if c.logprobs is not None and token_text is not None:
        tokens = [token_text(t) for t in c.token_ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        logprobs = {"tokens": tokens,
                    "token_logprobs": [float(lps.get(t, _FLOOR))
                                       for t, lps in zip(c.token_ids, c.logprobs)],
                    "top_logprobs": [{token_text(t): float(lp) for t, lp in
                                      sorted(lps.items(), key=lambda kv: -kv[1])[:c.num_top]}
                                     for lps in c.logprobs],
                    "text_offset": offsets}
    return {"index": i, "text": c.text, "logprobs": logprobs,
            "finish_reason": _FINISH.get(c.finish_reason or "", "stop")}
