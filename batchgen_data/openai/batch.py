"""OpenAI Batch input files: one JSON request per line, turned into engine requests.

The format is the one hosted batch APIs, vLLM's `run_batch` and BatchGen itself read:

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "any", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}}

`parse_line` never raises: a line that cannot be served becomes a `BatchRequest` whose `error`
says why (`code` + message naming the line), so the command writes an error line for it and the
job goes on. Body fields map onto `SamplingParams` with vLLM's server semantics; fields that only
describe the call (`model`, `user`, `metadata`, ...) are accepted and ignored; fields this engine
cannot honour (`functions`, `stream: true`, `echo`, ...) make the request an error that names them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from batchgen_data.openai import chat_fields
from batchgen_data.openai.pooling import POOLING_URLS, PoolingLine, parse_pooling_body
from batchgen_data.sampling_params import SamplingParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

# body fields copied to SamplingParams under the same name (vLLM's server accepts them too)
_SAME_NAME = ("temperature", "top_p", "n", "seed", "presence_penalty", "frequency_penalty",
              "logit_bias", "top_k", "min_p", "min_tokens", "repetition_penalty", "ignore_eos",
              "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
              "bad_words", "allowed_token_ids", "truncate_prompt_tokens")
# fields that describe the call, not the generation: accepted, no effect
_IGNORED = ("model", "user", "metadata", "store", "service_tier", "stream_options",
            "parallel_tool_calls", "prompt_cache_key", "safety_identifier")
# fields that would change the answer in a way this engine cannot produce
_REFUSED = {"functions": "function calling is not supported",
            "function_call": "function calling is not supported",
            "audio": "audio output is not supported", "modalities": "only text output is supported",
            "suffix": "suffix (insertion) is not supported", "echo": "echo is not supported",
            "best_of": "best_of is not supported (use n)", "prediction": "not supported",
            "web_search_options": "not supported"}
# values of refused fields that mean "off", so a client that always sends them still works
_OFF = (None, False, [], "none", "auto", 1)


@dataclass
class BatchRequest:
    """One input line: what to generate, or why it cannot be."""

    line: int  # 1-based line number in the input file
    custom_id: str | None
    url: str = CHAT_URL
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields
    # vLLM server's extra field: reaches the chat template (e.g. {"enable_thinking": False})
    chat_template_kwargs: dict[str, Any] | None = None
    model: str | None = None
    # a pooling endpoint's line (/v1/embeddings, /v1/score, /v1/rerank: openai/pooling.py)
    pooling: PoolingLine | None = None
    error_code: str | None = None
    error: str | None = None

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT_URL

    def row(self) -> dict[str, Any]:
        """The connector row for this request (`custom_id`, one prompt column, overrides)."""
        row: dict[str, Any] = {"custom_id": self.custom_id, "sampling_params": dict(self.params)}
        if self.model is not None:  # names a LoRA adapter when the engine has enable_lora
            row["model"] = self.model
        if self.chat_template_kwargs is not None:
            row["chat_template_kwargs"] = self.chat_template_kwargs
        if self.messages is not None:
            row["messages"] = self.messages
        elif self.prompt_token_ids is not None:
            row["prompt_token_ids"] = self.prompt_token_ids
        else:
            row["prompt"] = self.prompt
        return row


class _Bad(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# the columns a table row runs from (cli/inputs.py); a line with one of them is a table row
TABLE_PROMPT_COLUMNS = ("prompt", "messages", "prompt_token_ids")


def is_batch_line(obj: Any) -> bool:
    """Whether a decoded JSONL line is an OpenAI Batch request rather than a table row.

    A request has a `body` (or a `url` and no prompt column of its own), with or without a
    `custom_id`: a request that lacks its id is still a request, answered with a
    `missing_custom_id` error line, not a table whose rows have no prompt."""
    if not isinstance(obj, dict):
        return False
    if "custom_id" in obj and "body" in obj:
        return True
    return ("body" in obj or "url" in obj) and not any(c in obj for c in TABLE_PROMPT_COLUMNS)


def parse_line(text: str, line: int, default_max_tokens: int | None = None) -> BatchRequest:
    """The request on one input line; problems end up in `error`, never raised."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchRequest(line, None, error_code="invalid_json",
                            error=f"line {line}: not valid JSON ({e})")
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    req = BatchRequest(line, custom_id if isinstance(custom_id, str) else None)
    try:
        _fill(req, obj, default_max_tokens)
    except _Bad as e:
        req.error_code, req.error = e.code, f"line {line}: {e}"
    except (TypeError, ValueError) as e:
        req.error_code, req.error = "invalid_request", f"line {line}: {e}"
    return req


def _fill(req: BatchRequest, obj: Any, default_max_tokens: int | None) -> None:
    if not isinstance(obj, dict):
        raise _Bad("invalid_request", f"a request must be a JSON object, got {type(obj).__name__}")
    if not isinstance(obj.get("custom_id"), str) or not obj["custom_id"]:
        raise _Bad("missing_custom_id", "custom_id must be a non-empty string")
    method = obj.get("method", "POST")
    if method != "POST":
        raise _Bad("invalid_method", f"method {method!r}: only POST is supported")
    url = obj.get("url")
    if url in POOLING_URLS:
        if not isinstance(obj.get("body"), dict):
            raise _Bad("invalid_request", "body must be a JSON object")
        req.url = url
        req.model = obj["body"].get("model") if isinstance(obj["body"].get("model"), str) else None
        req.pooling = parse_pooling_body(url, obj["body"])
        return
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise _Bad("invalid_url", f"url {url!r}: use one of "
                                  f"{', '.join((CHAT_URL, COMPLETIONS_URL, *POOLING_URLS))}")
    req.url = url
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _Bad("invalid_request", "body must be a JSON object")
    known = set(_SAME_NAME) | set(_IGNORED) | set(_REFUSED) | {
        "messages", "prompt", "max_tokens", "max_completion_tokens", "stop", "logprobs",
        "top_logprobs", "response_format", "structured_outputs", "stream", "reasoning_effort",
        "chat_template_kwargs", "tools", "tool_choice"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise _Bad("unsupported_field", f"unsupported body field(s) {unknown}")
    refused = [f"{k} ({_REFUSED[k]})" for k in _REFUSED if k in body and body[k] not in _OFF]
    if body.get("stream"):
        refused.append("stream (batch output is never streamed)")
    if refused:
        raise _Bad("unsupported_field", "; ".join(refused))
    req.model = body.get("model") if isinstance(body.get("model"), str) else None
    _fill_prompt(req, body)
    try:
        req.chat_template_kwargs = chat_fields.template_kwargs(body, req.is_chat)
    except chat_fields.Unsupported as e:
        raise _Bad("unsupported_field", str(e)) from None
    req.params = sampling_fields(body, req.is_chat, default_max_tokens)
    # every runner gets the same verdict on a value (a string `n`, a NaN temperature): the
    # line's error, naming the field, before any runner builds a request from it
    SamplingParams.from_dict(dict(req.params))


def _fill_prompt(req: BatchRequest, body: dict[str, Any]) -> None:
    if req.is_chat:
        if "prompt" in body:
            raise _Bad("invalid_request", f"{CHAT_URL} takes messages, not prompt")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _Bad("invalid_request", "messages must be a non-empty list")
        req.messages = [_flat_message(m, i) for i, m in enumerate(messages)]
        return
    if "messages" in body:
        raise _Bad("invalid_request", f"{COMPLETIONS_URL} takes prompt, not messages")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a one-element batch is just that prompt
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        req.prompt_token_ids = prompt
    elif isinstance(prompt, list):
        raise _Bad("invalid_request", "prompt: several prompts in one request are not supported; "
                                      "give each its own line")
    else:
        raise _Bad("invalid_request", "prompt must be a string or a list of token ids")


def _flat_message(message: Any, i: int) -> Any:
    """OpenAI content parts `[{"type": "text", "text": ...}]` joined into one string: the
    chat template wants strings, and text parts are the only kind a text model reads. A
    message with `image_url` parts keeps its parts for the model's image pipeline
    (inputs/image_parts.py), which refuses them for a text-only model."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message  # the chat module reports a malformed message by its index
    texts, images = [], False
    for part in message["content"]:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in ("text", "image_url"):
            raise _Bad("invalid_request", f"messages[{i}]: content part of type {kind!r} is "
                                          "not supported (text and image_url only)")
        images = images or kind == "image_url"
        texts.append(str(part.get("text", "")))
    return message if images else {**message, "content": "".join(texts)}


def sampling_fields(body: dict[str, Any], chat: bool,
                    default_max_tokens: int | None = None) -> dict[str, Any]:
    """SamplingParams fields for a request body (vLLM's server mapping)."""
    params = {k: body[k] for k in _SAME_NAME if body.get(k) is not None}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    params["max_tokens"] = max_tokens
    if body.get("stop") is not None:
        params["stop"] = body["stop"]
    logprobs = _logprobs(body, chat)
    if logprobs is not None:
        params["logprobs"] = logprobs
    structured = _structured(body)
    if structured is not None:
        params["structured_outputs"] = structured
    budget = chat_fields.effort_budget(body)
    if budget is not None:
        params["thinking_token_budget"] = budget
    return params


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Chat: `logprobs: true` plus `top_logprobs: k`; completions: `logprobs: k`."""
    value = body.get("logprobs")
    if chat:
        if value is None or value is False:
            if body.get("top_logprobs"):
                raise _Bad("invalid_request", "top_logprobs needs logprobs: true")
            return None
        if value is not True:
            raise _Bad("invalid_request", f"logprobs must be true or false, got {value!r}")
        top = body.get("top_logprobs") or 0
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20:
            raise _Bad("invalid_request", f"top_logprobs must be an int in [0, 20], got {top!r}")
        return top
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 5:
        raise _Bad("invalid_request", f"logprobs must be an int in [0, 5], got {value!r}")
    return value


def _structured(body: dict[str, Any]) -> dict[str, Any] | None:
    """`response_format` as vLLM's `structured_outputs` dict (interfaces: json/json_object)."""
    if body.get("structured_outputs") is not None:
        return body["structured_outputs"]
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise _Bad("invalid_request", "response_format must be an object")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise _Bad("invalid_request", "response_format json_schema needs json_schema.schema")
        return {"json": spec["schema"]}
    raise _Bad("invalid_request", f"response_format type {kind!r}: use text, json_object or "
                                  "json_schema")
