"""Reasoning in the command's lines and the connectors' columns, no engine: the fields a line
may now carry (`reasoning_effort`, `chat_template_kwargs`), the reasoning in a response body
where OpenAI's types and DeepSeek's API put it, and the columns a Ray or Spark row carries it
in back to the command."""
from __future__ import annotations

import json

import pyarrow as pa
import pytest

from batchgen_data.cli.outcome import outcome_from_row
from batchgen_data.connectors.rows import error_row, output_schema, result_row
from batchgen_data.openai.batch import CHAT_URL, COMPLETIONS_URL, parse_line
from batchgen_data.openai.chat_fields import REASONING_EFFORT_BUDGETS
from batchgen_data.openai.batch_output import Choice, success_line
from batchgen_data.outputs import CompletionOutput, RequestOutput

HI = [{"role": "user", "content": "Hi"}]


def _line(url: str = CHAT_URL, **body: object) -> str:
    return json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": body})


@pytest.mark.parametrize("effort", sorted(REASONING_EFFORT_BUDGETS))
def test_reasoning_effort_is_a_thinking_budget(effort: str) -> None:
    req = parse_line(_line(messages=HI, reasoning_effort=effort), 1)
    assert req.error is None
    assert req.row()["sampling_params"]["thinking_token_budget"] == \
        REASONING_EFFORT_BUDGETS[effort]


def test_bad_reasoning_lines_name_the_field() -> None:
    req = parse_line(_line(messages=HI, reasoning_effort="extreme"), 3)
    assert req.error_code == "invalid_request" and "reasoning_effort='extreme'" in req.error
    req = parse_line(_line(COMPLETIONS_URL, prompt="Hi",
                           chat_template_kwargs={"enable_thinking": False}), 4)
    assert req.error_code == "invalid_request" and "chat_template_kwargs" in req.error
    req = parse_line(_line(messages=HI, chat_template_kwargs="off"), 5)
    assert req.error_code == "invalid_request"


def test_template_kwargs_reach_the_row() -> None:
    req = parse_line(_line(messages=HI, chat_template_kwargs={"enable_thinking": False}), 1)
    assert req.row()["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in parse_line(_line(messages=HI), 1).row()


def test_a_body_carries_the_reasoning_apart() -> None:
    types = pytest.importorskip("openai.types")
    line = success_line("c1", True, "m", [
        Choice("Paris", [5, 6, 7, 8], "stop", reasoning="The capital", reasoning_tokens=3),
        Choice("", [5, 6], "length", reasoning="The", reasoning_tokens=2)], prompt_tokens=4)
    raw = line["response"]["body"]
    assert [c["message"]["reasoning_content"] for c in raw["choices"]] == ["The capital", "The"]
    body = types.chat.ChatCompletion.model_validate(raw)
    assert body.usage.completion_tokens_details.reasoning_tokens == 5
    assert body.choices[0].message.content == "Paris"
    plain = success_line("c2", True, "m", [Choice("Paris", [5], "stop")], 4)["response"]["body"]
    assert "reasoning_content" not in plain["choices"][0]["message"]
    assert "completion_tokens_details" not in plain["usage"]


def test_the_columns_carry_the_reasoning_back() -> None:
    out = RequestOutput("r0", "hi", [1, 2], [CompletionOutput(
        0, "Paris", [4, 5, 6], "stop", reasoning_text="The capital", num_reasoning_tokens=2)])
    row = result_row(out)
    assert (row["generated_text"], row["reasoning_text"], row["num_reasoning_tokens"]) == (
        "Paris", "The capital", 2)
    assert error_row("bad")["reasoning_text"] is None
    assert output_schema().field("num_reasoning_tokens").type == pa.int32()
    choice = outcome_from_row(None, row, "actor-0").choices[0]  # type: ignore[arg-type]
    assert (choice.text, choice.reasoning, choice.reasoning_tokens) == ("Paris", "The capital", 2)


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def test_tools_reach_the_template_and_forcing_is_refused() -> None:
    req = parse_line(_line(messages=HI, tools=WEATHER, tool_choice="auto",
                           chat_template_kwargs={"enable_thinking": False}), 1)
    assert req.row()["chat_template_kwargs"] == {"enable_thinking": False, "tools": WEATHER}
    assert "chat_template_kwargs" not in parse_line(
        _line(messages=HI, tools=WEATHER, tool_choice="none"), 1).row()
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        req = parse_line(_line(messages=HI, tools=WEATHER, tool_choice=choice), 2)
        assert req.error_code == "unsupported_field" and "tool_choice" in req.error
    assert parse_line(_line(messages=HI, tools="get_weather"), 3).error_code == \
        "invalid_request"


def test_a_body_carries_the_calls() -> None:
    types = pytest.importorskip("openai.types")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    line = success_line("c1", True, "m", [Choice("", [5, 6], "tool_calls", tool_calls=[call])],
                        prompt_tokens=4)
    body = types.chat.ChatCompletion.model_validate(line["response"]["body"])
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.arguments == '{"city": "Paris"}'
    row = result_row(RequestOutput("r", None, [1], [CompletionOutput(
        0, "", [5, 6], "tool_calls", tool_calls=[call], tool_call_error=None)]))
    back = outcome_from_row(None, row, "actor-0").choices[0]  # type: ignore[arg-type]
    assert back.tool_calls == [call] and back.finish_reason == "tool_calls"
