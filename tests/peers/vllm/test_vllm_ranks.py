"""Port of vLLM's tests/samplers/test_ranks.py (distilgpt2 there, the tiny Llama here): with
logprobs asked for, a greedy token has rank 1 and a sampled one a rank >= 1, for every
position; prompt logprobs asked for at the same time."""
from __future__ import annotations

from batchgen_data import LLM, SamplingParams

ENGINE = {"max_logprobs": 5}
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France?",
           "def add(a, b):"]


# upstream: test_ranks
def test_ranks(llm: LLM) -> None:
    max_tokens, num_top, num_prompt = 5, 5, 5
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, top_p=1.0,
                                                  max_tokens=max_tokens, logprobs=num_top,
                                                  prompt_logprobs=num_prompt), use_tqdm=False)
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=1.0, seed=3,
                                                   max_tokens=max_tokens, logprobs=num_top,
                                                   prompt_logprobs=num_prompt), use_tqdm=False)
    for result in greedy:
        out = result.outputs[0]
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        for token, logprobs in zip(out.token_ids, out.logprobs):
            assert token in logprobs and logprobs[token].rank == 1
    ranks = []
    for result in sampled:
        out = result.outputs[0]
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        for token, logprobs in zip(out.token_ids, out.logprobs):
            assert logprobs[token].rank >= 1
            ranks.append(logprobs[token].rank)
    assert max(ranks) > 1  # temperature 1 on a random model draws outside the argmax
