"""Tool-call parsers against vLLM's own cases, rewritten for our API: the non-streaming cases
of vLLM's tests/tool_parsers/test_hermes_tool_parser.py, test_llama3_json_tool_parser.py and
test_pythonic_tool_parser.py (expected names, arguments and content as vLLM's
`extract_tool_calls` returns them), plus the mistral forms and the per-row error report."""
from __future__ import annotations

import json

import pytest

from batchgen_data.reasoning.tools import (TOOL_PARSERS, hermes, llama3_json, mistral, pythonic,
                                           tool_parser)


def fn(calls: list[dict]) -> list[tuple[str, object]]:
    """(name, decoded arguments) per call, each in OpenAI's shape."""
    for c in calls:
        assert c["type"] == "function" and c["id"] and isinstance(c["function"]["arguments"], str)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# test_hermes_tool_parser.py
def test_hermes() -> None:
    assert hermes("This is not a tool call.").calls == []
    between = hermes('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n'
                     '</tool_call>')
    assert between.calls[0]["function"] == {"name": "final_answer",
                                            "arguments": '{"trigger": true}'}
    assert between.content is None
    until_eos = hermes('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}')
    assert until_eos.calls[0]["function"]["arguments"] == '{"trigger": true}'
    bad = hermes('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}')
    assert bad.calls == [] and bad.content.startswith("<tool_call>") and "JSON" in bad.error
    serialized = hermes('<tool_call>\n{"name": "get_db_config", "arguments": '
                        '"{\\"param\\": \\"max_connections\\"}"}\n</tool_call>')
    assert fn(serialized.calls) == [("get_db_config", {"param": "max_connections"})]
    assert fn(hermes('<tool_call>\n{"name": "do_thing", "arguments": "hello"}\n</tool_call>'
                     ).calls) == [("do_thing", "hello")]
    two = hermes('Sure, let me check.<tool_call>{"name": "search", "arguments": {"q": "cats"}}'
                 '</tool_call><tool_call>{"name": "search", "arguments": {"q": "dogs"}}'
                 '</tool_call>')
    assert two.content == "Sure, let me check."
    assert fn(two.calls) == [("search", {"q": "cats"}), ("search", {"q": "dogs"})]


# test_llama3_json_tool_parser.py
@pytest.mark.parametrize("output, expected", [
    ('Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like '
     'to know more?', [("getOpenIncidentsTool", {})]),
    ('{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}',
     [("searchTool", {"query": "test query", "limit": 10})]),
    ('{"name": "searchTool", "arguments": {"query": "test"}}', [("searchTool", {"query": "test"})]),
    ('{"name": "searchTool", "parameters": {"query": "test1"}}; {"name": "getOpenIncidentsTool", '
     '"parameters": {}}; {"name": "searchTool", "parameters": {"query": "test2"}}',
     [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}),
      ("searchTool", {"query": "test2"})]),
    ('{"name": "complexTool", "parameters": {"level1": {"level2": {"level3": {"level4": '
     '{"value": "deep"}}}}}}',
     [("complexTool", {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}})]),
    ('{"name": "searchTool", "parameters": {"query": "test {value} [complex]","nested": '
     '{"inner": "more {brackets}"}}}',
     [("searchTool", {"query": "test {value} [complex]", "nested": {"inner": "more {brackets}"}})]),
    ('{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}',
     [("parserTool", {"text": 'He said "Hello {world}"'})]),
    ('{"name": "searchTool", "parameters": {"query": "test"}} I used {searchTool} for this.',
     [("searchTool", {"query": "test"})]),
    ('{"name": "searchTool", "parameters": {"query": "test"}} The arguments I passed were '
     '{"query": "test"}', [("searchTool", {"query": "test"})]),
])
def test_llama3_json_calls(output: str, expected: list) -> None:
    got = llama3_json(output)
    assert fn(got.calls) == expected and got.content is None


@pytest.mark.parametrize("output", [
    "This is just some text without any tool calls",
    '{"name": "invalidTool", "parameters": {invalid json}',
    '{"parameters": {}}', '{"name": "toolWithoutParams"}'])
def test_llama3_json_no_calls(output: str) -> None:
    assert llama3_json(output).calls == [] and llama3_json(output).content == output


# test_pythonic_tool_parser.py
SIMPLE = ("get_weather(city='San Francisco', metric='celsius')",
          ("get_weather", {"city": "San Francisco", "metric": "celsius"}))
MORE_TYPES = ("register_user(name='John Doe', age=37, address={'city': 'San Francisco', "
              "'state': 'CA'}, role=None, passed_test=True, aliases=['John', 'Johnny'])",
              ("register_user", {"name": "John Doe", "age": 37, "address": {
                  "city": "San Francisco", "state": "CA"}, "role": None, "passed_test": True,
                  "aliases": ["John", "Johnny"]}))


@pytest.mark.parametrize("calls", [
    [SIMPLE], [MORE_TYPES], [("get_weather()", ("get_weather", {}))],
    [("do_something_cool(additional_data={})", ("do_something_cool", {"additional_data": {}}))],
    [("do_something_cool(steps=[])", ("do_something_cool", {"steps": []}))],
    [(r"get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')",
      ("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'}))],
    [SIMPLE, MORE_TYPES],
])
def test_pythonic_calls(calls: list) -> None:
    got = pythonic("[" + ", ".join(text for text, _ in calls) + "]")
    assert fn(got.calls) == [c for _, c in calls] and got.content is None
    # vLLM's exact serialisation of the arguments
    assert pythonic(f"[{SIMPLE[0]}]").calls[0]["function"]["arguments"] == \
        '{"city": "San Francisco", "metric": "celsius"}'


def test_pythonic_bad_calls_are_reported_not_fatal() -> None:
    assert pythonic("How can I help you today?").content == "How can I help you today?"
    got = pythonic(f"[bad(x=b'z'), {SIMPLE[0]}]")  # a bytes argument: that call only
    assert fn(got.calls) == [SIMPLE[1]] and "tool call 0" in got.error
    inf = pythonic(f"[calc(x=1e999), {SIMPLE[0]}]")
    assert fn(inf.calls) == [SIMPLE[1]]
    broken = pythonic("[f(a='x 'y' 'z), g(b='p 'q' 'r)]")
    assert broken.calls == [] and broken.content == "[f(a='x 'y' 'z), g(b='p 'q' 'r)]"
    assert broken.error is not None


def test_mistral_both_forms() -> None:
    listed = mistral('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                     '{"name": "now", "arguments": {}}]')
    assert fn(listed.calls) == [("get_weather", {"city": "Paris"}), ("now", {})]
    assert listed.content is None
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in listed.calls)
    v11 = mistral('Checking.[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]now{}')
    assert v11.content == "Checking." and fn(v11.calls) == [("get_weather", {"city": "Paris"}),
                                                            ("now", {})]
    bad = mistral('[TOOL_CALLS]get_weather{"city": Paris}')
    assert bad.calls == [] and bad.error and bad.content.startswith("[TOOL_CALLS]")
    assert mistral("Plain answer.").content == "Plain answer."


def test_names() -> None:
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral", "pythonic"]
    with pytest.raises(ValueError, match=r"tool_call_parser='qwen'.*'hermes'"):
        tool_parser("qwen")
