"""batchgen_data: batch LLM inference as sequence coroutines, for Ray Data and Spark."""
from __future__ import annotations

from batchgen_data.llm import LLM
from batchgen_data.models.default_model import DEFAULT_MODEL
from batchgen_data.outputs import CompletionOutput, RequestOutput
from batchgen_data.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "DEFAULT_MODEL"]
__version__ = "0.1.0"
