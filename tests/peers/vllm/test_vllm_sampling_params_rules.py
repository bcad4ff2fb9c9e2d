"""vLLM 0.34.0's `SamplingParams` rules, read from vllm/sampling_params.py (`__post_init__`,
`_verify_args`, `_verify_greedy_sampling`, `_verify_num_sequences`) and written as tests, since
upstream tests only some of them: the values vLLM rewrites, the ones it refuses, and its
messages (a caller matches on them; ours put `SamplingParams.` in front)."""
from __future__ import annotations

import re

import pytest

from batchgen_data import SamplingParams


# upstream: SamplingParams.__post_init__ (seed=-1, logprobs=True, small temperatures)
def test_values_vllm_rewrites() -> None:
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(logprobs=True).logprobs == 1
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(temperature=0.001).temperature == 0.01  # below 1e-2: raised to it
    assert SamplingParams(temperature=0.0).temperature == 0.0  # greedy stays greedy
    assert SamplingParams(stop_token_ids=[5, 3, 5]).stop_token_ids == [5, 3]
    assert SamplingParams(bad_words=["a", "b", "a"]).bad_words == ["a", "b"]
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(logprobs=-1).logprobs == -1  # the vocabulary (engine's max_logprobs)


# upstream: SamplingParams._verify_args and friends, message by message
@pytest.mark.parametrize("kw,vllm_message", [
    (dict(n=0), "n must be at least 1, got 0."),
    (dict(n=1.5), "n must be an int, but is of type"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5."),
    (dict(frequency_penalty=-3.0), "frequency_penalty must be in [-2, 2], got -3.0."),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0."),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
    (dict(temperature=float("nan")), "temperature must be a finite number, got nan."),
    (dict(temperature=-0.5), "temperature must be non-negative, got -0.5."),
    (dict(temperature=2.5), "temperature must be in [0, 2], got 2.5."),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0."),
    (dict(top_k=-2), "top_k must be 0 (disable), or at least 1, got -2."),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5."),
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0."),
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
    (dict(min_tokens=5, max_tokens=3), "min_tokens must be less than or equal to "
                                       "max_tokens=3, got 5."),
    (dict(logprobs=-2), "logprobs must be non-negative or -1, got -2."),
    (dict(prompt_logprobs=-3), "prompt_logprobs must be non-negative or -1, got -3."),
    (dict(stop_token_ids=[1, "x"]), "stop_token_ids must contain only integers"),
    (dict(stop=[""]), "stop cannot contain an empty string."),
    (dict(stop=["x"], detokenize=False), "stop strings are only supported when detokenize "
                                         "is True. Set detokenize=True to use stop."),
    (dict(bad_words=[""]), "bad_words cannot contain an empty string."),
    (dict(temperature=0.0, n=2), "n must be 1 when using greedy sampling, got 2."),
])
def test_refusals_carry_vllms_words(kw: dict, vllm_message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(vllm_message)) as info:
        SamplingParams(**kw)
    assert str(info.value).startswith("SamplingParams.")  # and the field is named


# upstream: _verify_num_sequences raises vLLM's validation error (a ValueError in every
# release before 0.34) for n=1.5; here it is a TypeError too, by Python's convention
@pytest.mark.parametrize("kw", [dict(n=1.5), dict(stop_token_ids="abc"), dict(top_k=2.0),
                                dict(bad_words={"a": "b"})])
def test_wrong_types_are_both_type_and_value_errors(kw: dict) -> None:
    with pytest.raises(TypeError) as info:
        SamplingParams(**kw)
    assert isinstance(info.value, ValueError) and next(iter(kw)) in str(info.value)


# upstream: SamplingParams.verify (_validate_stop_token_ids, _validate_logit_bias,
# _validate_allowed_token_ids): ids are columns of the logits, checked against the vocabulary
@pytest.mark.parametrize("kw,vllm_message", [
    (dict(stop_token_ids=[3, 64]), "token_id(s) [64] in stop_token_ids contain out-of-vocab "
                                   "token ids. Vocabulary size: 64"),
    (dict(logit_bias={70: 1.0}), "token_id(s) [70] in logit_bias contain out-of-vocab token "
                                 "ids. Vocabulary size: 64"),
    (dict(allowed_token_ids=[1, 99]), "allowed_token_ids contains out-of-vocab token id!"),
])
def test_vocabulary_checks_carry_vllms_words(kw: dict, vllm_message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(vllm_message)):
        SamplingParams(**kw).check_vocab(64)
    with pytest.raises(ValueError, match=re.escape("allowed_token_ids is not None and empty!")):
        SamplingParams(allowed_token_ids=[])


def test_clone_is_a_deep_copy() -> None:
    sp = SamplingParams(stop=["a"], logit_bias={1: 2.0})
    twin = sp.clone()
    assert twin == sp and twin.stop is not sp.stop and twin.logit_bias is not sp.logit_bias
