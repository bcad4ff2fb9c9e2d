"""Port of vLLM's tests/entrypoints/llm/test_encode.py (intfloat/e5-mistral-7b-instruct there,
the tiny random Llama as an embedding model here): `LLM.encode` with one PoolingParams per
prompt, one for all, or none; token-id prompts give the outputs their text gives. vLLM 0.34
asks for the `pooling_task` ("embed" here); the legacy `prompt_token_ids=` keyword is gone there
and absent here."""
from __future__ import annotations

import pytest

from batchgen_data import LLM, PoolingParams

PROMPTS = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]


@pytest.fixture(scope="module")
def embedder(model: str) -> LLM:
    return LLM(model, runner="pooling")


# upstream: test_multiple_pooling_params
def test_multiple_pooling_params(embedder: LLM) -> None:
    params = [PoolingParams() for _ in PROMPTS]
    outputs = embedder.encode(PROMPTS, pooling_params=params, pooling_task="embed", use_tqdm=False)
    assert len(outputs) == len(PROMPTS)
    with pytest.raises(ValueError):
        embedder.encode(PROMPTS, pooling_params=params[:3], pooling_task="embed")
    single = embedder.encode(PROMPTS, pooling_params=PoolingParams(), pooling_task="embed",
                             use_tqdm=False)
    none = embedder.encode(PROMPTS, pooling_params=None, pooling_task="embed", use_tqdm=False)
    assert [o.outputs for o in single] == [o.outputs for o in none] == \
        [o.outputs for o in outputs]


# upstream: test_v1_v2_api_consistency_multi_prompt_tokens (token ids against their text)
def test_token_id_prompts_match_text_prompts(embedder: LLM) -> None:
    tok = embedder.get_tokenizer()
    by_text = embedder.encode(PROMPTS, pooling_task="embed", use_tqdm=False)
    by_ids = embedder.encode([{"prompt_token_ids": tok(p)["input_ids"]} for p in PROMPTS],
                             pooling_task="embed", use_tqdm=False)
    assert [o.outputs for o in by_ids] == [o.outputs for o in by_text]
    assert [o.outputs for o in by_text] == \
        [o.outputs for o in embedder.embed(PROMPTS, use_tqdm=False)]
