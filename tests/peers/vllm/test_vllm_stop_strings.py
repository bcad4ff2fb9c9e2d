"""Port of vLLM's tests/detokenizer/test_stop_strings.py: where greedy output is cut by a stop
string (one token, several tokens, part of a token) or a stop token id, with and without
`include_stop_str_in_output`, and `stop_reason`.

Upstream writes the expected texts out for llama-2-7b ("VLLM is a 100% volunteer organization
..."); here they are cut by hand from the default model's unstopped greedy text (the first
occurrence of each stop string, which the test picks to occur once before its cut)."""
from __future__ import annotations

from typing import Any

import pytest

from batchgen_data import LLM, SamplingParams

PROMPT = "A story about vLLM:\n"
MAX_TOKENS = 32


def stopping(llm: LLM, expected_output: str, expected_reason: Any, **kw: Any) -> None:
    """upstream: _test_stopping"""
    include = kw.pop("include_in_output", False)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                              include_stop_str_in_output=include, **kw),
                       use_tqdm=False)[0].outputs[0]
    text = out.text if kw.get("detokenize", True) else \
        llm.get_tokenizer().decode(list(out.token_ids))
    assert text == expected_output
    assert out.stop_reason == expected_reason


@pytest.mark.slow
def test_stop_strings(default_llm: LLM) -> None:
    llm = default_llm
    ref = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                       use_tqdm=False)[0].outputs[0]
    text = ref.text
    # upstream: _stop_basic (a one-character stop string)
    dot = text.index(".")
    stopping(llm, text[:dot], ".", stop=["."])
    stopping(llm, text[:dot + 1], ".", stop=["."], include_in_output=True)
    # upstream: _stop_multi_tokens (the first of two stop strings to occur wins)
    words = text[dot + 1:].split()
    phrase = " ".join(words[1:3])
    at = text.index(phrase)
    assert phrase not in text[:at + len(phrase) - 1]
    stopping(llm, text[:at], phrase, stop=[phrase, "zebra crossing"])
    stopping(llm, text[:at + len(phrase)], phrase, stop=[phrase, "zebra crossing"],
             include_in_output=True)
    # upstream: _stop_partial_token (a stop string inside one token)
    word = next(w for w in text.split() if len(w) >= 6 and w.isalpha())
    part = word[2:5]
    at = text.index(part)
    stopping(llm, text[:at], part, stop=[part])
    stopping(llm, text[:at + len(part)], part, stop=[part], include_in_output=True)
    # upstream: _stop_token_id (the stop token's text is left out unless asked for)
    ids = list(ref.token_ids)
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    tok = llm.get_tokenizer()
    stopping(llm, tok.decode(ids[:k], skip_special_tokens=True), ids[k], stop_token_ids=[ids[k]])
    stopping(llm, tok.decode(ids[:k + 1], skip_special_tokens=True), ids[k],
             stop_token_ids=[ids[k]], include_in_output=True)
