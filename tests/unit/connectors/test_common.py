"""connectors/common.py, cells.py and the generation columns of rows.py: row validation, batch
conversion and output columns, with a fake tokenizer (one token per character) so no model is
needed."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from batchgen_data.connectors.cells import batch_rows, to_arrow
from batchgen_data.connectors.common import RequestBuilder
from batchgen_data.connectors.handler import RowError
from batchgen_data.connectors.rows import (
    OUTPUT_COLUMNS, attach_outputs, error_row, output_schema, result_row)
from batchgen_data.outputs import CompletionOutput, RequestOutput
from batchgen_data.sampling_params import SamplingParams


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) % 97 for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):  # type: ignore[no-untyped-def]
        if messages[0]["role"] == "assistant":
            raise ValueError("conversation must start with a user turn")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def _check(ids: list[int], params: SamplingParams) -> None:
    if len(ids) >= 40:
        raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is 40")


@pytest.fixture
def builder() -> RequestBuilder:
    return RequestBuilder(CharTokenizer(), {"max_tokens": 8, "temperature": 0.0}, _check)


def test_prompt_row(builder: RequestBuilder) -> None:
    req = builder.build({"id": 1, "prompt": "hi"})
    assert req.prompt_token_ids == [1, ord("h") % 97, ord("i") % 97]
    assert req.prompt == "hi" and req.params.max_tokens == 8 and req.params.temperature == 0.0


def test_messages_use_chat_template_without_special_tokens(builder: RequestBuilder) -> None:
    req = builder.build({"messages": [{"role": "user", "content": "yo", "name": None}]})
    assert req.prompt == "<user>yo<assistant>"
    assert req.prompt_token_ids[0] != 1  # template text is not given a second BOS


class TemplatedTokenizer(CharTokenizer):
    chat_template = "<role>content ..."  # any non-empty template: a chat model's tokenizer


def test_plain_prompts_are_one_user_turn_when_the_tokenizer_has_a_template() -> None:
    tok = TemplatedTokenizer()
    chat = RequestBuilder(tok, None)
    req = chat.build({"prompt": "hi"})
    assert req.prompt == "<user>hi<assistant>"
    assert req.prompt_token_ids == tok.encode("<user>hi<assistant>", add_special_tokens=False)
    assert chat.build({"prompt_token_ids": [4, 5]}).prompt_token_ids == [4, 5]  # never templated
    raw = RequestBuilder(tok, None, apply_chat_template=False)
    assert raw.build({"prompt": "hi"}).prompt_token_ids == tok.encode("hi")
    # without the template a messages column is just another column
    assert raw.build({"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}).prompt == "hi"


def test_token_ids_row_and_first_non_null_column_wins(builder: RequestBuilder) -> None:
    req = builder.build({"prompt": None, "prompt_token_ids": np.array([5, 6, 7])})
    assert req.prompt_token_ids == [5, 6, 7] and req.prompt is None
    assert builder.build({"prompt": "a", "prompt_token_ids": None}).prompt == "a"


@pytest.mark.parametrize("row, fragment", [
    ({"id": 3}, "none of the input columns"),
    ({"prompt": None}, "prompt is null"),
    ({"prompt": float("nan")}, "prompt is null"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": " \n\t"}, "prompt is empty"),
    ({"prompt": 42}, "must be a string, got int"),
    ({"prompt": "x" * 50}, "max_model_len is 40"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "user"}]}, "needs string 'role' and 'content'"),
    ({"messages": ["hello"]}, "must be a dict"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "chat template failed"),
    ({"prompt_token_ids": [1, "a"]}, "is not an int"),
    ({"prompt": "ok", "sampling_params": {"temprature": 0.5}}, "unknown sampling parameter"),
    ({"prompt": "ok", "sampling_params": {"max_tokens": 0}}, "max_tokens"),
    ({"prompt": "ok", "sampling_params": "{not json"}, "not valid JSON"),
    ({"prompt": "ok", "response_format": {"type": "xml"}}, "response_format.type"),
    ({"prompt": "ok", "structured_outputs": '{"regex": "a", "choice": ["b"]}'}, "exactly one"),
    ({"prompt": "ok", "sampling_params": {"response_format": "{bad"}}, "not valid JSON"),
    ({"prompt": "ok", "chat_template_kwargs": {"tokenize": True}}, "may not set"),
])
def test_bad_rows_give_clear_errors(builder: RequestBuilder, row: dict, fragment: str) -> None:
    with pytest.raises(RowError, match=fragment):
        builder.build(row)
    assert fragment.split("'")[0] in builder.try_build(row)  # type: ignore[operator]


def test_overrides_from_struct_json_and_nulls(builder: RequestBuilder) -> None:
    struct = {"max_tokens": 3, "temperature": None, "seed": 7}  # Arrow struct: absent = None
    p = builder.build({"prompt": "a", "sampling_params": struct}).params
    assert (p.max_tokens, p.temperature, p.seed) == (3, 0.0, 7)
    p = builder.build({"prompt": "a", "sampling_params": '{"top_k": 5}'}).params
    assert p.top_k == 5 and p.max_tokens == 8
    assert builder.build({"prompt": "a", "sampling_params": None}).params == builder.default_params


def test_batch_formats_agree() -> None:
    rows = [{"id": 1, "prompt": "a", "ids": [1, 2]}, {"id": 2, "prompt": None, "ids": [3]}]
    table = pa.Table.from_pylist(rows)
    df = table.to_pandas()
    numpy_batch = {c: df[c].to_numpy() for c in df.columns}
    for batch in (table, table.to_batches()[0], df, numpy_batch):
        assert batch_rows(batch) == rows
    assert to_arrow(pd.DataFrame({"x": [1.5, float("nan")]})).column("x").null_count == 1


def test_output_rows_and_attach_keeps_inputs() -> None:
    out = RequestOutput("r0", "hi", [1, 2, 3], [CompletionOutput(0, "yo", [4, 5], "stop")])
    ok = result_row(out)
    assert ok == {"generated_text": "yo", "generated_token_ids": [4, 5], "num_prompt_tokens": 3,
                  "num_generated_tokens": 2, "finish_reason": "stop", "error": None,
                  "logprobs": None, "top_logprobs": None, "samples": None,
                  "reasoning_text": None, "num_reasoning_tokens": None, "tool_calls": None,
                  "tool_call_error": None}
    bad = error_row("prompt is null")
    assert bad["error"] == "prompt is null" and bad["generated_token_ids"] == []
    table = pa.table({"id": [10, 11, 12], "prompt": ["a", "b", None], "error": ["x", "y", "z"]})
    got = attach_outputs(table, [2, 0], [bad, ok])
    assert got.column_names == ["id", "prompt", *OUTPUT_COLUMNS]
    assert got.column("id").to_pylist() == [12, 10]
    assert got.column("error").to_pylist() == ["prompt is null", None]
    assert got.select(list(OUTPUT_COLUMNS)).schema == output_schema()
