"""Port of vLLM's tests/samplers/test_non_finite_params.py (advisory GHSA-7h4p-rffg-7823): NaN
and infinite temperature / repetition_penalty are refused at construction, finite ones kept."""
from __future__ import annotations

import math

import pytest

from batchgen_data import SamplingParams

NON_FINITE = [float("nan"), float("inf"), float("-inf"), math.nan, math.inf]
IDS = ["nan", "inf", "-inf", "math.nan", "math.inf"]


# upstream: TestNonFiniteTemperature.test_non_finite_temperature_rejected
@pytest.mark.parametrize("value", NON_FINITE, ids=IDS)
def test_non_finite_temperature_rejected(value: float) -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=value)


# upstream: TestNonFiniteTemperature.test_finite_temperature_accepted
def test_finite_temperature_accepted() -> None:
    for t in (0.0, 0.5, 1.0, 2.0):
        assert SamplingParams(temperature=t).temperature == t


# upstream: TestNonFiniteRepetitionPenalty.test_non_finite_repetition_penalty_rejected
@pytest.mark.parametrize("value", NON_FINITE, ids=IDS)
def test_non_finite_repetition_penalty_rejected(value: float) -> None:
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=value)


# upstream: TestNonFiniteRepetitionPenalty.test_finite_repetition_penalty_accepted
def test_finite_repetition_penalty_accepted() -> None:
    for p in (0.5, 1.0, 2.0):
        assert SamplingParams(repetition_penalty=p).repetition_penalty == p
