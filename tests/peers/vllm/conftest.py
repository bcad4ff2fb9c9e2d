"""Fixtures for vLLM's public-behaviour tests ported onto this project (one file per upstream
test file, each test naming its upstream function).

Upstream runs them on small hub models (gpt2, distilgpt2, tiny-random Llama); here they run on
the tiny random Llama of tests/conftest.py (`llm`, one engine per test module, built with the
module's `ENGINE` kwargs), or on the default model where a test needs real text (marked slow).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from batchgen_data import LLM


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[..., Path]) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def llm(model: str, request: pytest.FixtureRequest) -> LLM:
    return LLM(model, **getattr(request.module, "ENGINE", {}))


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    """The embedded default model (SmolLM2-135M-Instruct): for the tests whose assertions need
    real words (a random model's text is bytes that do not round-trip); mark them slow."""
    return LLM(max_model_len=512)
