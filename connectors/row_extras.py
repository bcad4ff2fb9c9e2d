"""Row fields beyond a prompt and its sampling overrides, for both connectors: structured
output, chat-template options, and the logprobs / n > 1 output columns.

Per-row input columns (each optional, null = use the connector's default):
  * `structured_outputs`: a dict/struct with `StructuredOutputsParams` fields, or its JSON text;
  * `response_format`: OpenAI's, as a dict/struct or JSON text (`{"type": "json_schema", ...}`);
  * `chat_template_kwargs`: a dict/struct (or JSON text) merged over the connector's default.
The same keys may also sit inside a row's `sampling_params` (and `response_format` in a
connector's default `sampling_params`).

Output columns added to every row (null when the row did not ask for them):
  * `logprobs`: list<float>, the logprob of each generated token (SamplingParams.logprobs set);
  * `top_logprobs`: list<list<struct<token_id, logprob>>>, per generated token the top-k
    candidates (k = SamplingParams.logprobs) plus the sampled token when it is not among them
    (vLLM's shape), best first;
  * `samples`: with n > 1, a list of all n samples (`index, text, token_ids, finish_reason,
    logprobs`). One row stays one row, whatever n is: a Spark scalar UDF must return one value
    per input row, an `id` keeps joining one-to-one, and a row's result still returns through
    the task that received it. The first sample is also in `generated_text` & co; a user who
    wants one row per sample explodes the column (`ds.flat_map`, Spark's `explode`).
  * `reasoning_text`, `num_reasoning_tokens`: with the engine's `reasoning_parser`, the
    reasoning apart from `generated_text` (the answer) and its token count (docs/reasoning.md).
  * `tool_calls`, `tool_call_error`: with the engine's `tool_call_parser`, the calls in the
    answer (OpenAI's shape, arguments as JSON text; `finish_reason` "tool_calls"), and why a
    call could not be read (the answer then stays text).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pyarrow as pa

from batchgen_data.inputs.chat import check_template_kwargs
from batchgen_data.sampling_params import SamplingParams
from batchgen_data.structured import StructuredOutputsParams, from_response_format

ROW_FIELDS = ("structured_outputs", "response_format", "chat_template_kwargs")
_TOKEN_LOGPROB = pa.struct([pa.field("token_id", pa.int32()), pa.field("logprob", pa.float32())])
# a tool call in OpenAI's shape (CompletionOutput.tool_calls)
_TOOL_CALL = pa.struct([
    pa.field("id", pa.string()), pa.field("type", pa.string()),
    pa.field("function", pa.struct([pa.field("name", pa.string()),
                                    pa.field("arguments", pa.string())])),
])
_SAMPLE = pa.struct([
    pa.field("index", pa.int32()), pa.field("text", pa.string()),
    pa.field("token_ids", pa.list_(pa.int32())), pa.field("finish_reason", pa.string()),
    pa.field("logprobs", pa.list_(pa.float32())),
])


def output_fields() -> list[pa.Field]:
    return [pa.field("logprobs", pa.list_(pa.float32())),
            pa.field("top_logprobs", pa.list_(pa.list_(_TOKEN_LOGPROB))),
            pa.field("samples", pa.list_(_SAMPLE)),
            pa.field("reasoning_text", pa.string()),
            pa.field("num_reasoning_tokens", pa.int32()),
            pa.field("tool_calls", pa.list_(_TOOL_CALL)),
            pa.field("tool_call_error", pa.string())]


def empty_columns() -> dict[str, Any]:
    return {f.name: None for f in output_fields()}


def _sampled_logprobs(c: Any) -> list[float] | None:
    if c.logprobs is None:
        return None
    # the sampled token is each dict's first key (sample/sampler.py builds them that way)
    return [d[t] for t, d in zip(c.token_ids, c.logprobs)]


def result_columns(out: Any) -> dict[str, Any]:
    """`logprobs`, `top_logprobs`, `samples`, the reasoning and the tool calls of a finished
    RequestOutput."""
    first = out.outputs[0]
    top = None
    if first.logprobs is not None:
        top = [[{"token_id": t, "logprob": lp}
                for t, lp in sorted(d.items(), key=lambda kv: -kv[1])] for d in first.logprobs]
    samples = None
    if len(out.outputs) > 1:
        samples = [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                    "finish_reason": c.finish_reason, "logprobs": _sampled_logprobs(c)}
                   for c in out.outputs]
    return {"logprobs": _sampled_logprobs(first), "top_logprobs": top, "samples": samples,
            "reasoning_text": first.reasoning_text,
            "num_reasoning_tokens": first.num_reasoning_tokens,
            "tool_calls": first.tool_calls, "tool_call_error": first.tool_call_error}


def _json_value(value: Any, name: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    return value


def _drop_nulls(value: Any) -> Any:
    """An Arrow struct column gives every row every key of every row, null where absent: drop
    them from a schema read back from one (rows with different schemas should use JSON text)."""
    if isinstance(value, Mapping):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def structured_override(values: Mapping[str, Any]) -> tuple[bool, StructuredOutputsParams | None]:
    """(given, constraint) from a row's (or overrides') `structured_outputs` / `response_format`;
    given=False when neither is there. `response_format: {"type": "text"}` is given, as None:
    that row is unconstrained even when the default is not. ValueError names the field."""
    so = values.get("structured_outputs")
    rf = values.get("response_format")
    if so is not None and rf is not None:
        raise ValueError("give structured_outputs or response_format, not both")
    if so is not None:
        so = _json_value(so, "structured_outputs")
        if isinstance(so, Mapping) and isinstance(so.get("json"), Mapping):
            so = {**so, "json": _drop_nulls(so["json"])}
        try:
            return True, StructuredOutputsParams.from_value(so)
        except TypeError as e:
            raise ValueError(str(e)) from None
    if rf is not None:
        return True, from_response_format(_drop_nulls(_json_value(rf, "response_format")))
    return False, None


def template_kwargs(value: Any, default: Mapping[str, Any] | None) -> dict[str, Any]:
    """A row's `chat_template_kwargs` (dict, struct or JSON text) over the default."""
    row = check_template_kwargs(_drop_nulls(_json_value(value, "chat_template_kwargs")))
    return {**(default or {}), **row}


def lift_structured(overrides: dict[str, Any], error: type[Exception] = ValueError
                    ) -> dict[str, Any]:
    """Sampling overrides with a `response_format` (or `structured_outputs` JSON text) turned
    into the `structured_outputs` field SamplingParams takes."""
    if "response_format" not in overrides and "structured_outputs" not in overrides:
        return overrides
    out = {k: v for k, v in overrides.items() if k not in ("response_format", "structured_outputs")}
    try:
        given, spec = structured_override(overrides)
    except ValueError as e:
        raise error(f"bad sampling_params: {e}") from None
    if given:
        out["structured_outputs"] = spec
    return out


def default_params(value: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    """A connector's default `sampling_params`, which may use OpenAI's `response_format`."""
    if isinstance(value, Mapping):
        value = lift_structured(dict(value))
        if "structured_outputs" in value and value["structured_outputs"] is None:
            del value["structured_outputs"]
        return SamplingParams.from_dict(value)
    return SamplingParams.from_dict(value)

