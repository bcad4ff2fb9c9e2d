from __future__ import annotations

import pytest

from batchgen_data import SamplingParams


@pytest.mark.parametrize("kw,field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=3), "min_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(n=0), "n"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_invalid_values_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw", [dict(max_tokens="5"), dict(temperature="hot"), dict(seed=1.5),
                                dict(n=1.0)])
def test_wrong_types_raise_type_error(kw: dict) -> None:
    with pytest.raises(TypeError):
        SamplingParams(**kw)


def test_from_dict_and_overrides() -> None:
    sp = SamplingParams.from_dict({"temperature": 0, "max_tokens": 5, "stop": "END"})
    assert sp.stop == ["END"] and sp.greedy
    assert sp.merged({"max_tokens": 9}).max_tokens == 9 and sp.max_tokens == 5
    with pytest.raises(TypeError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"temprature": 0})
