"""OpenAI Batch lines in (parse_line) and out (success_line / error_line), no engine."""
from __future__ import annotations

import json

import pytest

from batchgen_data.openai.batch import CHAT_URL, COMPLETIONS_URL, parse_line
from batchgen_data.openai.batch_output import Choice, error_line, success_line


def _line(url: str = CHAT_URL, custom_id: str = "a", **body: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_chat_body_maps_to_sampling_fields() -> None:
    req = parse_line(_line(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=9,
                           max_tokens=99, temperature=0.5, top_p=0.9, n=2, stop="x", seed=3,
                           logprobs=True, top_logprobs=3, model="m", user="u"), 1)
    assert req.error is None and req.is_chat and req.model == "m"
    assert req.params == {"temperature": 0.5, "top_p": 0.9, "n": 2, "seed": 3, "max_tokens": 9,
                          "stop": "x", "logprobs": 3}
    assert req.row()["messages"] == [{"role": "user", "content": "hi"}]


def test_completions_prompt_forms() -> None:
    req = parse_line(_line(COMPLETIONS_URL, prompt=["only one"], logprobs=2), 4, 64)
    assert req.prompt == "only one" and req.params == {"max_tokens": 64, "logprobs": 2}
    assert parse_line(_line(COMPLETIONS_URL, prompt=[1, 2, 3]), 1).prompt_token_ids == [1, 2, 3]
    bad = parse_line(_line(COMPLETIONS_URL, prompt=["a", "b"]), 5)
    assert bad.error_code == "invalid_request" and bad.error.startswith("line 5: ")


def test_text_content_parts_are_joined_and_image_parts_kept() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = parse_line(_line(messages=[{"role": "user", "content": parts}]), 1)
    assert req.messages == [{"role": "user", "content": "ab"}]
    img = [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "a"}]
    req = parse_line(_line(messages=[{"role": "user", "content": img}]), 1)
    assert req.error is None and req.messages[0]["content"] == img  # for the image pipeline
    audio = [{"type": "input_audio", "input_audio": {}}]
    assert "input_audio" in parse_line(_line(messages=[{"role": "user", "content": audio}]),
                                       1).error


@pytest.mark.parametrize("rf, expected", [
    ({"type": "json_object"}, {"json_object": True}),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}},
     {"json": {"type": "object"}}),
    ({"type": "text"}, None),
])
def test_response_format_maps_to_structured_outputs(rf: dict, expected: object) -> None:
    req = parse_line(_line(messages=[{"role": "user", "content": "x"}], response_format=rf), 1)
    assert req.params.get("structured_outputs") == expected


@pytest.mark.parametrize("text, code", [
    ("{not json", "invalid_json"),
    (json.dumps({"method": "POST", "url": CHAT_URL, "body": {}}), "missing_custom_id"),
    (_line("/v1/audio/speech", input="x"), "invalid_url"),
    (_line("/v1/embeddings", input=[]), "invalid_request"),
    (_line("/v1/embeddings", input="x", encoding_format="int8"), "invalid_request"),
    (_line(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}],
           tool_choice="required"), "unsupported_field"),
    (_line(messages=[{"role": "user", "content": "x"}], stream=True), "unsupported_field"),
    (_line(messages=[{"role": "user", "content": "x"}], frobnicate=1), "unsupported_field"),
    (_line(prompt="x"), "invalid_request"),
    (_line(messages=[{"role": "user", "content": "x"}], logprobs=3), "invalid_request"),
])
def test_bad_lines_become_errors_naming_the_line(text: str, code: str) -> None:
    req = parse_line(text, 7)
    assert req.error_code == code and req.error.startswith("line 7: ")


def test_off_values_of_refused_fields_are_accepted() -> None:
    req = parse_line(_line(messages=[{"role": "user", "content": "x"}], tools=[],
                           tool_choice="none", stream=False, echo=False), 1)
    assert req.error is None


def _vocab(t: int) -> str:
    return {5: "Hi", 6: " there", 7: "!"}[t]


def test_success_bodies_validate_with_openai_types() -> None:
    types = pytest.importorskip("openai.types")
    chat = success_line("c1", True, "m", [
        Choice("Hi there", [5, 6], "stop", [{5: -0.1, 7: -2.0}, {6: -0.5, 7: -0.7}], 1),
        Choice("Hi!", [5, 7], "length")], prompt_tokens=4, token_text=_vocab)
    body = types.chat.ChatCompletion.model_validate(chat["response"]["body"])
    assert body.usage.total_tokens == 8 and body.choices[1].finish_reason == "length"
    top = body.choices[0].logprobs.content[1].top_logprobs
    assert [t.token for t in top] == [" there"]  # the one best, not the sampled-plus-best pair
    text = success_line("t1", False, "m", [Choice("Hi!", [5, 7], "stop", [{5: -0.1}, {7: -1.0}],
                                                  1)], 2, _vocab)
    body = types.Completion.model_validate(text["response"]["body"])
    assert body.choices[0].logprobs.text_offset == [0, 2]
    assert json.loads(json.dumps(chat)) == chat  # plain JSON, nothing else


def test_error_line_shape() -> None:
    line = error_line("x", "invalid_request", "line 3: bad")
    assert line["response"] is None and line["error"] == {"code": "invalid_request",
                                                          "message": "line 3: bad"}
    assert line["id"].startswith("batch_req_")


@pytest.mark.parametrize("url, body, pairs", [
    ("/v1/score", {"queries": "q", "documents": ["a", "b"]}, [("q", "a"), ("q", "b")]),
    ("/score", {"queries": ["q1", "q2"], "items": ["a", "b"]}, [("q1", "a"), ("q2", "b")]),
    ("/v1/score", {"data_1": "q", "data_2": "a"}, [("q", "a")]),
    ("/v1/score", {"text_1": "q", "text_2": ["a"]}, [("q", "a")]),
    ("/v2/rerank", {"query": "q", "documents": ["a", "b"], "top_n": 0}, [("q", "a"), ("q", "b")]),
])
def test_score_and_rerank_shapes_of_vllm(url: str, body: dict, pairs: list) -> None:
    req = parse_line(_line(url, **body, use_activation=False, request_id="x", priority=0), 1)
    assert req.error is None, req.error
    assert req.pooling is not None and req.pooling.inputs == pairs
    assert req.pooling.params == {"activation": False}
    assert req.pooling.kind == ("rerank" if "rerank" in url else "score")
    assert req.pooling.top_n is None  # 0: every document, as vLLM reads it


@pytest.mark.parametrize("body, match", [
    ({"queries": "q", "documents": ["a"], "text_2": ["b"]}, "one pair of fields"),
    ({"queries": "q"}, "one pair of fields"),
    ({"queries": "q", "documents": ["a", "b"], "priority": 3}, "priority=3"),
    ({"queries": ["q1", "q2"], "documents": ["a", "b", "c"]}, "2 queries for 3 documents"),
])
def test_score_bodies_that_cannot_run(body: dict, match: str) -> None:
    req = parse_line(_line("/v1/score", **body), 4)
    assert req.error_code == "invalid_request" and match in req.error, req.error


def test_a_string_n_is_the_lines_error_naming_the_field() -> None:
    req = parse_line(_line(messages=[{"role": "user", "content": "x"}], n="2"), 2)
    assert req.error_code == "invalid_request" and "SamplingParams.n" in req.error
