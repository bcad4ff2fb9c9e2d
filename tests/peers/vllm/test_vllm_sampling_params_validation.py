"""Port of vLLM's tests/samplers/test_sampling_params_validation.py: the type and content checks
of `stop_token_ids`, `stop` and `bad_words` at construction, also under `python -O`.

Upstream expects TypeError for a value of the wrong type and ValueError for bad content; ours
raise `ParamTypeError` for the first (both a TypeError and a ValueError).
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from batchgen_data import SamplingParams


# upstream: test_stop_token_ids_validation
def test_stop_token_ids_validation() -> None:
    assert SamplingParams(stop_token_ids=[1, 2, 3]).stop_token_ids == [1, 2, 3]
    with pytest.raises(TypeError, match="stop_token_ids must be a list"):
        SamplingParams(stop_token_ids="not_a_list")
    with pytest.raises(ValueError, match="stop_token_ids must contain only integers"):
        SamplingParams(stop_token_ids=[1, "not_an_int", 3])


# upstream: test_stop_validation
def test_stop_validation() -> None:
    assert SamplingParams(stop=["END", "STOP"]).stop == ["END", "STOP"]
    with pytest.raises(TypeError, match="stop must be a list"):
        SamplingParams(stop=123)
    with pytest.raises(ValueError, match="stop cannot contain an empty string"):
        SamplingParams(stop=["END", ""])


# upstream: test_bad_words_validation
def test_bad_words_validation() -> None:
    assert SamplingParams(bad_words=["bad", "word"]).bad_words == ["bad", "word"]
    with pytest.raises(TypeError, match="bad_words must be a list"):
        SamplingParams(bad_words={"bad": "word"})
    with pytest.raises(ValueError, match="bad_words cannot contain an empty string"):
        SamplingParams(bad_words=["bad", ""])


# upstream: test_validation_under_optimized_mode (the checks are not asserts: -O keeps them)
def test_validation_under_optimized_mode() -> None:
    code = ("from batchgen_data import SamplingParams\n"
            "try:\n    SamplingParams(stop_token_ids='not_a_list')\n    print('FAILED')\n"
            "except TypeError:\n    print('PASSED')\n")
    result = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip().endswith("PASSED")
