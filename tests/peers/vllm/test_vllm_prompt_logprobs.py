"""Port of vLLM's tests/entrypoints/llm/test_prompt_logprobs.py (Meta-Llama-3-8B and 1024
prompt tokens there; the tiny Llama and 1000 here, its positions being 1024): prompt logprobs of
a long prompt with top-p / top-k sampling, computed in slices without running out of memory;
one entry per prompt token, the first None."""
from __future__ import annotations

from batchgen_data import LLM, SamplingParams

ENGINE = {"max_model_len": 1024}


# upstream: test_prompt_logprobs
def test_prompt_logprobs(llm: LLM) -> None:
    params = SamplingParams(top_p=0.9, top_k=50, temperature=0.8, prompt_logprobs=10,
                            max_tokens=1)
    vocab = llm.engine.vocab_size
    token_ids = [i % vocab for i in range(1000)]
    out = llm.generate({"prompt_token_ids": token_ids}, params, use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(token_ids)
    for tok, lps in zip(token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in lps and len(lps) in (10, 11)
        assert set(range(1, 11)) <= {lp.rank for lp in lps.values()}
