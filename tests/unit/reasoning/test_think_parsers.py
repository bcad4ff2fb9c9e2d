"""The `<think>` parsers against vLLM's own cases, rewritten for our API.

Text cases: vLLM's tests/reasoning/test_deepseekr1_reasoning_parser.py (the non-streaming
ones) and tests/reasoning/test_qwen3_reasoning_parser.py (non-streaming, and
test_reasoning_thinking_disabled), with their expected (reasoning, content) pairs as vLLM's
`extract_reasoning` returns them. Token cases: vLLM's `is_reasoning_end` (the last think tag
decides) read on a prompt, and the reasoning token count, on a tiny BPE tokenizer that
registers the tags as added, non-special tokens like both families' tokenizers.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from batchgen_data.reasoning.registry import REASONING_PARSERS, reasoning_parser
from batchgen_data.reasoning.think import DEFAULT_END_STR, DeepSeekR1Parser, Qwen3Parser
from tests.conftest import build_tokenizer

TOOL_CALL_BODY = ("<tool_call>\n<function=bash>\n<parameter=command>\ncat /etc/hosts\n"
                  "</parameter>\n</function>\n</tool_call>")

# test_deepseekr1_reasoning_parser.py, streaming=False: output, reasoning, content
R1_CASES = {
    "simple_reasoning": ("This is a reasoning section</think>This is the rest",
                         "This is a reasoning section", "This is the rest"),
    "complete_reasoning": ("This is a reasoning section</think>",
                           "This is a reasoning section", None),
    "no_content_token": ("This is content", "This is content", None),
    "multiple_lines": ("This\nThat</think>This is the rest\nThat", "This\nThat",
                       "This is the rest\nThat"),
    "shortest_streaming": ("</think>This is the rest", "", "This is the rest"),
    "reasoning_with_think": ("<think>This is a reasoning section</think>This is the rest",
                             "This is a reasoning section", "This is the rest"),
    "complete_reasoning_with_think": ("<think>This is a reasoning section</think>",
                                      "This is a reasoning section", None),
    "multiple_lines_with_think": ("<think>This\nThat</think>This is the rest\nThat",
                                  "This\nThat", "This is the rest\nThat"),
    "shortest_with_think": ("</think>This is the rest", "", "This is the rest"),
    "think_no_end": ("<think>This is a reasoning section", "This is a reasoning section", None),
    "empty": ("", "", None),
    "new_line": ("\n<think>This is a reasoning section</think>\nThis is the rest",
                 "This is a reasoning section", "\nThis is the rest"),
}

# test_qwen3_reasoning_parser.py, streaming=False
QWEN3_CASES = {
    "without_start_token": ("This is a reasoning section</think>This is the rest",
                            "This is a reasoning section", "This is the rest"),
    "without_start_token_complete_reasoning": ("This is a reasoning section</think>",
                                               "This is a reasoning section", None),
    "with_think": ("<think>This is a reasoning section</think>This is the rest",
                   "This is a reasoning section", "This is the rest"),
    "without_think": ("This is the rest", "This is the rest", None),
    "complete_reasoning": ("<think>This is a reasoning section</think>",
                           "This is a reasoning section", None),
    "multiline_reasoning": ("<think>This is a reasoning\nsection</think>This is the rest\nThat",
                            "This is a reasoning\nsection", "This is the rest\nThat"),
    "only_open_tag": ("<think>This is a reasoning section", "This is a reasoning section", None),
    "truncated_no_start_token": ("This is a reasoning section", "This is a reasoning section",
                                 None),
    "tool_call_no_think_end": ("I need to read the file.\n\n" + TOOL_CALL_BODY,
                               "I need to read the file.\n\n", TOOL_CALL_BODY),
    "tool_call_with_think_no_end": ("<think>I need to read the file.\n\n" + TOOL_CALL_BODY,
                                    "I need to read the file.\n\n", TOOL_CALL_BODY),
}

# test_reasoning_thinking_disabled: chat_template_kwargs={"enable_thinking": False}
QWEN3_DISABLED = ["This is plain content", "Some output without think tokens",
                  "I need to read the file.\n\n" + TOOL_CALL_BODY]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    t = build_tokenizer(tmp_path_factory.mktemp("think-tok"))
    t.add_tokens(["<think>", "</think>"])
    return t


@pytest.mark.parametrize("case", sorted(R1_CASES))
def test_deepseek_r1_split_is_vllms(case: str, tok) -> None:  # type: ignore[no-untyped-def]
    output, reasoning, content = R1_CASES[case]
    assert reasoning_parser("deepseek_r1", tok).split(output) == (reasoning, content)


@pytest.mark.parametrize("case", sorted(QWEN3_CASES))
def test_qwen3_split_is_vllms(case: str, tok) -> None:  # type: ignore[no-untyped-def]
    output, reasoning, content = QWEN3_CASES[case]
    assert reasoning_parser("qwen3", tok).split(output) == (reasoning, content)


@pytest.mark.parametrize("output", QWEN3_DISABLED)
def test_qwen3_thinking_disabled_is_all_content(output: str, tok) -> None:  # type: ignore[no-untyped-def]
    assert reasoning_parser("qwen3", tok).split(output, thinking=False) == (None, output)


# vLLM's is_reasoning_end cases (R1 file): True exactly when the last think tag is the end
@pytest.mark.parametrize("text, ended", [
    ("This is a reasoning section</think>This is the rest", True),
    ("This is content", False),
    ("<think>This is a reasoning section", False),
    ("<think>This is a reasoning section</think>", True),
    ("", False),
])
def test_the_last_tag_of_a_prompt_decides(text: str, ended: bool, tok) -> None:  # type: ignore[no-untyped-def]
    parser = DeepSeekR1Parser(tok)
    assert (parser.prompt_thinking(tok.encode(text)) is False) == ended


def test_a_row_is_read_from_its_prompt(tok) -> None:  # type: ignore[no-untyped-def]
    """Qwen3's template with enable_thinking=False writes an empty think block into the
    prompt: that row's output is all answer; an R1 prompt left open is all reasoning until
    the model closes it, and the count leaves the tags out."""
    parser = Qwen3Parser(tok)
    answer = tok.encode("The quick brown fox")
    off = parser.parse(tok.encode("Hi<think>\n\n</think>\n\n"), answer, "The quick brown fox")
    assert (off.reasoning, off.content, off.num_reasoning_tokens) == (None, "The quick brown fox",
                                                                      0)
    thought = tok.encode("the lazy dog")
    out = thought + [parser.end_id] + answer
    on = parser.parse(tok.encode("Hi<think>\n"), out, "the lazy dog</think>The quick brown fox")
    assert (on.reasoning, on.content, on.num_reasoning_tokens) == (
        "the lazy dog", "The quick brown fox", len(thought))
    opened = [parser.start_id] + thought + [parser.end_id] + answer  # the model opens it
    assert parser.parse(tok.encode("Hi"), opened, "").num_reasoning_tokens == len(thought)
    cut = parser.parse(tok.encode("Hi<think>\n"), thought, "the lazy dog")  # max_tokens
    assert (cut.reasoning, cut.content, cut.num_reasoning_tokens) == ("the lazy dog", "",
                                                                      len(thought))


def test_the_budget_text_ends_with_the_closing_tag(tok) -> None:  # type: ignore[no-untyped-def]
    parser = reasoning_parser("qwen3", tok)
    assert parser.end_ids == tok.encode(DEFAULT_END_STR, add_special_tokens=False)
    assert parser.end_id in parser.end_ids
    assert reasoning_parser("qwen3", tok, "Stop.</think>").end_ids[-1] == parser.end_id
    with pytest.raises(ValueError, match="reasoning_end_str"):
        reasoning_parser("qwen3", tok, "Stop thinking now.")


def test_names_and_errors(tmp_path: Path, tok) -> None:  # type: ignore[no-untyped-def]
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match=r"reasoning_parser='deepseek'.*\['deepseek_r1', 'qwen3'\]"):
        reasoning_parser("deepseek", tok)
    plain = build_tokenizer(tmp_path)  # no think tags: not a reasoning model's tokenizer
    with pytest.raises(ValueError, match="no \\['<think>', '</think>'\\]"):
        reasoning_parser("deepseek_r1", plain)
