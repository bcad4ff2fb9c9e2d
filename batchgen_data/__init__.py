"""batchgen_data: batch LLM inference as sequence coroutines, for Ray Data and Spark.

The public names are imported on first use, so that a process needing only a light module
(`batchgen_data.placement` in the migration coordinator, `batchgen_data.sampling_params` in a
driver) does not pay for torch and the engine.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen_data.llm import LLM
    from batchgen_data.inputs.prompts import PromptType, TextPrompt, TokensPrompt
    from batchgen_data.logprobs import Logprob
    from batchgen_data.lora_request import LoRARequest
    from batchgen_data.models.default_model import DEFAULT_MODEL
    from batchgen_data.outputs import CompletionOutput, RequestOutput
    from batchgen_data.pooling_params import (ClassificationOutput, ClassificationRequestOutput,
                                              EmbeddingOutput, EmbeddingRequestOutput,
                                              PoolingParams, PoolingRequestOutput, ScoringOutput,
                                              ScoringRequestOutput)
    from batchgen_data.programs.api import Generate, GenerateResult, program
    from batchgen_data.sampling_params import SamplingParams
    from batchgen_data.structured import StructuredOutputsParams

_LAZY = {
    "LLM": "batchgen_data.llm",
    "LoRARequest": "batchgen_data.lora_request",
    "DEFAULT_MODEL": "batchgen_data.models.default_model",
    "CompletionOutput": "batchgen_data.outputs",
    "RequestOutput": "batchgen_data.outputs",
    "SamplingParams": "batchgen_data.sampling_params",
    "PoolingParams": "batchgen_data.pooling_params",
    "PoolingRequestOutput": "batchgen_data.pooling_params",
    # vLLM's other top-level names for results and prompts
    "EmbeddingOutput": "batchgen_data.pooling_params",
    "EmbeddingRequestOutput": "batchgen_data.pooling_params",
    "ClassificationOutput": "batchgen_data.pooling_params",
    "ClassificationRequestOutput": "batchgen_data.pooling_params",
    "ScoringOutput": "batchgen_data.pooling_params",
    "ScoringRequestOutput": "batchgen_data.pooling_params",
    "Logprob": "batchgen_data.logprobs",
    "PromptType": "batchgen_data.inputs.prompts",
    "TextPrompt": "batchgen_data.inputs.prompts",
    "TokensPrompt": "batchgen_data.inputs.prompts",
    "program": "batchgen_data.programs.api",
    "Generate": "batchgen_data.programs.api",
    "GenerateResult": "batchgen_data.programs.api",
    "StructuredOutputsParams": "batchgen_data.structured",
}

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "DEFAULT_MODEL", "program", "Generate", "GenerateResult",
           "PoolingParams", "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
           "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
           "ScoringRequestOutput", "Logprob", "PromptType", "TextPrompt", "TokensPrompt"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'batchgen_data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
