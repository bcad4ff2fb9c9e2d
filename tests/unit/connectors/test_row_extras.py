"""connectors/row_extras.py through the shared RequestBuilder: per-row structured output and
chat-template options, and the logprobs / top_logprobs / samples output columns."""
from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pytest

from batchgen_data import StructuredOutputsParams
from batchgen_data.connectors.common import RequestBuilder
from batchgen_data.connectors.handler import RowError
from batchgen_data.connectors.rows import attach_outputs, error_row, output_schema, result_row
from batchgen_data.outputs import CompletionOutput, RequestOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
RF = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}


class KwargsTokenizer:
    """One token per character; its chat template shows the options it was given."""

    chat_template = "builtin"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 97 for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = False, chat_template: str = "builtin",
                            **kwargs: Any) -> str:
        return f"[{chat_template}|{json.dumps(kwargs, sort_keys=True)}]{messages[-1]['content']}"


def builder(**kw: Any) -> RequestBuilder:
    return RequestBuilder(KwargsTokenizer(), kw.pop("default", {"max_tokens": 4}), **kw)


def test_structured_columns_and_defaults() -> None:
    b = builder(default={"max_tokens": 4, "response_format": RF})
    assert b.default_params.structured_outputs == StructuredOutputsParams(json=SCHEMA)
    assert b.build({"prompt": "x"}).params.structured_outputs.json == SCHEMA
    # a row may swap the constraint, or drop it with response_format text
    got = b.build({"prompt": "x", "structured_outputs": {"regex": "a+", "json": None}}).params
    assert got.structured_outputs == StructuredOutputsParams(regex="a+")
    assert b.build({"prompt": "x", "response_format": '{"type": "text"}'}).params \
        .structured_outputs is None
    assert b.build({"prompt": "x", "sampling_params": {"response_format": {"type": "text"}}}) \
        .params.structured_outputs is None
    # Arrow structs fill absent keys with null: they are not schema keywords
    row = {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer",
                                                                        "minimum": None}}}}}}
    assert builder().build(row).params.structured_outputs.json == SCHEMA
    with pytest.raises(RowError, match="not both"):
        b.build({"prompt": "x", "response_format": RF, "structured_outputs": {"regex": "a"}})


def test_chat_template_and_its_kwargs_reach_the_template() -> None:
    b = builder(chat_template="mine", chat_template_kwargs={"enable_thinking": False, "x": 1})
    assert b.build({"prompt": "hi"}).prompt == '[mine|{"enable_thinking": false, "x": 1}]hi'
    row = {"messages": [{"role": "user", "content": "yo"}],
           "chat_template_kwargs": '{"enable_thinking": true}'}
    assert b.build(row).prompt == '[mine|{"enable_thinking": true, "x": 1}]yo'
    assert builder().build({"prompt": "hi"}).prompt == "[builtin|{}]hi"
    with pytest.raises(ValueError, match="may not set"):
        builder(chat_template_kwargs={"add_generation_prompt": False})


def test_logprobs_top_logprobs_and_samples_columns() -> None:
    lp = [{7: -0.5, 3: -0.1}, {8: -0.2, 9: -1.5}]  # sampled token first, then the top-k
    outs = [CompletionOutput(0, "ab", [7, 8], "stop", logprobs=lp),
            CompletionOutput(1, "c", [5], "length", logprobs=[{5: -2.0, 3: -0.3}])]
    row = result_row(RequestOutput("r", "p", [1, 2], outs))
    assert row["generated_text"] == "ab" and row["logprobs"] == [-0.5, -0.2]
    assert row["top_logprobs"] == [[{"token_id": 3, "logprob": -0.1},
                                    {"token_id": 7, "logprob": -0.5}],
                                   [{"token_id": 8, "logprob": -0.2},
                                    {"token_id": 9, "logprob": -1.5}]]
    assert [s["text"] for s in row["samples"]] == ["ab", "c"]
    assert row["samples"][1] == {"index": 1, "text": "c", "token_ids": [5],
                                 "finish_reason": "length", "logprobs": [-2.0]}
    single = result_row(RequestOutput("r", "p", [1], [outs[0]]))
    assert single["samples"] is None
    table = attach_outputs(pa.table({"id": [1, 2]}), [0, 1], [row, error_row("bad")])
    assert table.select(output_schema().names).schema == output_schema()
    assert table.column("samples").to_pylist()[1] is None
    assert table.column("top_logprobs").to_pylist()[0][1][1]["token_id"] == 9
