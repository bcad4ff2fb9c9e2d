"""Port of vLLM's tests/entrypoints/llm/test_prompt_validation.py (gpt2 there, the tiny Llama
here): an empty prompt and an out-of-vocabulary token id are refused with vLLM's words; and
vLLM's input processor's length rule (`_validate_prompt_len`): a prompt must leave room for
one output token under max_model_len."""
from __future__ import annotations

import pytest

from batchgen_data import LLM, SamplingParams

ENGINE = {"max_model_len": 32}


# upstream: test_empty_prompt
def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(ValueError, match="decoder prompt cannot be empty"):
        llm.generate([""])
    with pytest.raises(ValueError, match="decoder prompt cannot be empty"):
        llm.generate({"prompt_token_ids": []})


# upstream: test_out_of_vocab_token
def test_out_of_vocab_token(llm: LLM) -> None:
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate({"prompt_token_ids": [999999]})
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate({"prompt_token_ids": [-1]})


# upstream: vllm/v1/engine/input_processor.py InputProcessor._validate_prompt_len
@pytest.mark.parametrize("length", [32, 40])
def test_prompt_longer_than_max_model_len(llm: LLM, length: int) -> None:
    with pytest.raises(ValueError, match="longer than the maximum model length of 32"):
        llm.generate({"prompt_token_ids": [5] * length}, SamplingParams(max_tokens=1))
    out = llm.generate({"prompt_token_ids": [5] * 31}, SamplingParams(max_tokens=1),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1
