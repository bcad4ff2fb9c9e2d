"""Port of vLLM's tests/entrypoints/llm/test_generate.py (distilgpt2 there, the tiny Llama
here): one SamplingParams per prompt or one for all, `priority` (one, or one per prompt; the
lengths must agree), `max_tokens` beyond `max_model_len` capped by it, and `metrics`."""
from __future__ import annotations

import pytest

from batchgen_data import LLM, SamplingParams

ENGINE = {"max_num_batched_tokens": 4096}
PROMPTS = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]


# upstream: test_multiple_sampling_params
def test_multiple_sampling_params(llm: LLM) -> None:
    sampling_params = [SamplingParams(temperature=t, top_p=0.95) for t in (0.01, 0.3, 0.7, 0.99)]
    assert len(llm.generate(PROMPTS, sampling_params=sampling_params, use_tqdm=False)) == 4
    with pytest.raises(ValueError):
        llm.generate(PROMPTS, sampling_params=sampling_params[:3])
    single = SamplingParams(temperature=0.3, top_p=0.95)
    assert len(llm.generate(PROMPTS, sampling_params=single, use_tqdm=False)) == 4
    assert len(llm.generate(PROMPTS, sampling_params=None, use_tqdm=False)) == 4


# upstream: test_multiple_priority
def test_multiple_priority(llm: LLM) -> None:
    for priority in (None, [0] * len(PROMPTS), 1):
        outputs = llm.generate(PROMPTS, sampling_params=None, priority=priority, use_tqdm=False)
        assert len(outputs) == len(PROMPTS)
    for priority in ([0] * (len(PROMPTS) - 1), []):
        with pytest.raises(ValueError, match="must be the same"):
            llm.generate(PROMPTS, sampling_params=None, priority=priority)


# upstream: test_single_prompt_priority
def test_single_prompt_priority(llm: LLM) -> None:
    assert len(llm.generate(PROMPTS[0], sampling_params=None, priority=[0], use_tqdm=False)) == 1
    assert len(llm.generate(PROMPTS[0], sampling_params=None, priority=1, use_tqdm=False)) == 1


# upstream: test_max_model_len
def test_max_model_len(model: str) -> None:
    max_model_len = 40  # upstream 20: this tiny tokenizer spends more tokens per word
    llm = LLM(model, max_model_len=max_model_len, enforce_eager=True)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_model_len + 10), use_tqdm=False)
    for output in outputs:
        # total tokens never exceed max_model_len (fewer if the output ended on its own)
        assert len(output.prompt_token_ids) + len(output.outputs[0].token_ids) <= max_model_len
    ignored = llm.generate(PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True),
                           use_tqdm=False)[0]
    total = len(ignored.prompt_token_ids) + len(ignored.outputs[0].token_ids)
    assert total == max_model_len and ignored.outputs[0].finish_reason == "length"


# upstream: test_log_stats. vLLM fills `metrics` only when statistics are logged; this engine
# logs none (disable_log_stats is accepted either way) and leaves it None, as vLLM's LLM does
# by default; its counters are LLM.engine.stats
def test_log_stats(model: str) -> None:
    llm = LLM(model, disable_log_stats=False)
    outputs = llm.generate(PROMPTS, sampling_params=None, use_tqdm=False)
    assert all(hasattr(output, "metrics") and output.metrics is None for output in outputs)
    assert llm.engine.stats.num_finished >= len(PROMPTS)
