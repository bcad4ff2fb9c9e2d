"""Port of vLLM's tests/detokenizer/test_stop_reason.py: the three ways to finish with "stop" —
a stop token (stop_reason is its id), a stop string (stop_reason is the string) and EOS
(stop_reason None). Upstream runs distilgpt2 with "." as both the stop token and the stop
string; here the default model, whose tokenizer also has "." as one token."""
from __future__ import annotations

import pytest

from batchgen_data import LLM, SamplingParams

STOP_STR = "."
SEED = 42
MAX_TOKENS = 48
PROMPTS = ["Write two sentences about the sea.", "Explain what a compiler does.",
           "Describe a busy train station."]


# upstream: test_stop_reason
@pytest.mark.slow
def test_stop_reason(default_llm: LLM) -> None:
    tokenizer = default_llm.get_tokenizer()
    stop_token_id = tokenizer.convert_tokens_to_ids(STOP_STR)
    # stop token
    outputs = default_llm.generate(PROMPTS, SamplingParams(
        ignore_eos=True, seed=SEED, max_tokens=MAX_TOKENS, stop_token_ids=[stop_token_id]),
        use_tqdm=False)
    for output in outputs:
        out = output.outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop_token_id
    # stop string
    outputs = default_llm.generate(PROMPTS, SamplingParams(
        ignore_eos=True, seed=SEED, max_tokens=MAX_TOKENS, stop="."), use_tqdm=False)
    for output in outputs:
        out = output.outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == STOP_STR
    # EOS
    outputs = default_llm.generate(PROMPTS, SamplingParams(seed=SEED, max_tokens=16),
                                   use_tqdm=False)
    for output in outputs:
        out = output.outputs[0]
        assert out.finish_reason == "length" or (out.finish_reason == "stop"
                                                 and out.stop_reason is None)
