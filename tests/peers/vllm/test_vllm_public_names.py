"""vLLM 0.34.0's public offline names (vllm/__init__.py MODULE_ATTRS, vllm/logprobs.py,
vllm/entrypoints/llm.py), present here where docs/vllm-compat.md says they are: importable from
`batchgen_data` under the same names, and the ones it lists as absent really absent (so the
table cannot drift from the package)."""
from __future__ import annotations

import inspect
import pickle
from pathlib import Path

import pytest

import batchgen_data

PRESENT = ["LLM", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
           "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
           "ScoringRequestOutput", "PromptType", "TextPrompt", "TokensPrompt"]
ABSENT = ["EngineArgs", "AsyncEngineArgs", "LLMEngine", "AsyncLLMEngine", "ModelRegistry",
          "initialize_ray_cluster", "PoolingOutput"]
LLM_METHODS = ["generate", "chat", "encode", "embed", "classify", "score", "get_tokenizer",
               "get_default_sampling_params", "reset_prefix_cache"]
DOC = Path(__file__).resolve().parents[3] / "docs" / "vllm-compat.md"


@pytest.mark.parametrize("name", PRESENT)
def test_top_level_names(name: str) -> None:
    assert getattr(batchgen_data, name) is not None and name in batchgen_data.__all__


@pytest.mark.parametrize("name", ABSENT)
def test_absent_names_are_absent_and_documented(name: str) -> None:
    assert not hasattr(batchgen_data, name)
    assert f"`{name}`" in DOC.read_text()


def test_llm_methods_and_generate_keywords() -> None:
    from batchgen_data import LLM

    for name in LLM_METHODS:
        assert callable(getattr(LLM, name)), name
    params = inspect.signature(LLM.generate).parameters
    assert {"prompts", "sampling_params", "use_tqdm", "lora_request", "priority"} <= set(params)


# vllm/logprobs.py: Logprob(logprob, rank=None, decoded_token=None), a dataclass there
def test_logprob_is_vllms_shape() -> None:
    from batchgen_data.logprobs import Logprob

    lp = Logprob(logprob=-0.25, rank=2, decoded_token=" a")
    assert (lp.logprob, lp.rank, lp.decoded_token) == (-0.25, 2, " a")
    assert Logprob(-1.0).rank is None and Logprob(-1.0).decoded_token is None
    assert lp == Logprob(-0.25, 2, " a") and lp != Logprob(-0.25, 1, " a")
    assert pickle.loads(pickle.dumps(lp)) == lp
    assert repr(lp) == "Logprob(logprob=-0.25, rank=2, decoded_token=' a')"
    assert lp + 0.25 == 0.0  # and the float it replaces (docs/vllm-compat.md)
