"""Port of vLLM's tests/v1/sample/test_sampling_params_e2e.py: each sampling field through
`LLM.generate` (upstream: hmellor/tiny-random-LlamaForCausalLM; here the tiny random Llama, and
the default model where the assertion reads words: stop strings, bad words).

Where upstream picks the stop word / stop ids at fixed positions of a greedy reference run,
this picks the first positions whose word / token does not occur earlier in that run, so the
expected cut point is the only one; the tiny model's reference run is seeded rather than greedy
(its greedy output loops on a few tokens)."""
from __future__ import annotations

import pytest

from batchgen_data import LLM, SamplingParams

ENGINE = {"max_model_len": 128}
PROMPT = "Hello my name is Robert and I"


def greedy(llm: LLM, **kw: object) -> object:
    return llm.generate(PROMPT, SamplingParams(temperature=0, **kw), use_tqdm=False)[0].outputs[0]


def seeded(llm: LLM, **kw: object) -> object:
    """A seeded draw: its tokens up to any stop are those of the unstopped run."""
    params = SamplingParams(temperature=1.0, seed=7, **kw)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


# upstream: test_n_gt_1
def test_n_gt_1(llm: LLM) -> None:
    outputs = llm.generate(PROMPT, SamplingParams(n=3), use_tqdm=False)
    assert len(outputs[0].outputs) == 3


# upstream: test_best_of (best_of is deprecated: a ValueError; here at construction)
def test_best_of(llm: LLM) -> None:
    with pytest.raises(ValueError):
        llm.generate(PROMPT, SamplingParams(n=2, best_of=3))


# upstream: test_penalties
def test_penalties(llm: LLM) -> None:
    params = SamplingParams(temperature=1.2, presence_penalty=1.2, frequency_penalty=1.2,
                            repetition_penalty=1.2, min_p=0.5, top_p=0.5, top_k=3)
    assert llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


# upstream: test_stop
@pytest.mark.slow
def test_stop(default_llm: LLM) -> None:
    llm = default_llm
    words = greedy(llm, max_tokens=24, ignore_eos=True).text.split()
    idx = next(i for i in range(3, len(words)) if words[i] not in " ".join(words[:i]))
    out = greedy(llm, max_tokens=24, ignore_eos=True, stop=words[idx])
    assert len(out.text.split()) == idx  # without the stop word
    out = greedy(llm, max_tokens=24, ignore_eos=True, stop=words[idx],
                 include_stop_str_in_output=True)
    assert len(out.text.split()) == idx + 1  # with it


# upstream: test_stop_token_ids; and the text rule of tests/detokenizer/test_stop_token_ids.py
# (test_fast_incremental_detokenizer_*) on a real tokenizer
def test_stop_token_ids(llm: LLM) -> None:
    ref = list(seeded(llm, max_tokens=32, ignore_eos=True).token_ids)
    i = next(i for i in range(2, len(ref) - 1)
             if ref[i] not in ref[:i] and ref[i + 1] not in ref[:i + 1])
    first, second = ref[i], ref[i + 1]
    for stop_ids in ([second, first], [first, second]):
        out = seeded(llm, max_tokens=32, ignore_eos=True, stop_token_ids=stop_ids)
        assert out.token_ids[-1] == first and out.stop_reason == first
    tok = llm.get_tokenizer()
    out = seeded(llm, max_tokens=32, ignore_eos=True, stop_token_ids=[first])
    assert out.text == tok.decode(ref[:i], skip_special_tokens=True)
    out = seeded(llm, max_tokens=32, ignore_eos=True, stop_token_ids=[first],
                 include_stop_str_in_output=True)
    assert out.text == tok.decode(ref[:i + 1], skip_special_tokens=True)


# upstream: test_detokenize_false
def test_detokenize_false(llm: LLM) -> None:
    output = llm.generate(PROMPT, SamplingParams(detokenize=False), use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) > 0 and len(output[0].outputs[0].text) == 0
    output = llm.generate(PROMPT, SamplingParams(detokenize=False, logprobs=3, prompt_logprobs=3),
                          use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) > 0 and len(output[0].outputs[0].text) == 0
    prompt_logprobs = output[0].prompt_logprobs
    sampled_logprobs = output[0].outputs[0].logprobs
    assert len(prompt_logprobs) > 1 and len(sampled_logprobs) > 1
    for all_logprobs in (prompt_logprobs[1:], sampled_logprobs):
        for logprobs in all_logprobs:
            assert 3 <= len(logprobs) <= 4
            assert all(lp.decoded_token is None for lp in logprobs.values())


# upstream: test_bad_words
@pytest.mark.slow
def test_bad_words(default_llm: LLM) -> None:
    llm = default_llm
    text = greedy(llm).text
    words = text.split()
    bad_1 = " ".join(words[:2])
    new_text = greedy(llm, bad_words=[bad_1]).text
    assert not has_words(new_text, bad_1)
    bad_2 = new_text.split()[-1]
    new_text = greedy(llm, bad_words=[bad_1, bad_2]).text
    assert not has_words(new_text, bad_1) and not has_words(new_text, bad_2)


def has_words(text: str, words: str) -> bool:
    """Whether `words` occur in `text` as whole words. (Upstream asks for the substring, which
    holds for its model; a bad word bans token sequences, as in vLLM, so "'m a" may still be
    the start of "'m an".)"""
    w, t = words.split(), text.split()
    return any(t[i:i + len(w)] == w for i in range(len(t)))


# upstream: test_logits_processor (refused: upstream a ValueError; here a TypeError for the
# unknown keyword, a ValueError naming it through SamplingParams.from_dict)
def test_logits_processor(llm: LLM) -> None:
    def pick_ith(token_ids: list[int], logits: object) -> object:
        return logits

    with pytest.raises((TypeError, ValueError)):
        llm.generate(PROMPT, SamplingParams(logits_processors=[pick_ith]))  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams.from_dict({"logits_processors": [pick_ith]})


# upstream: test_allowed_token_ids
def test_allowed_token_ids(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(allowed_token_ids=[10]), use_tqdm=False)
    assert out[0].outputs[0].token_ids[-1] == 10
    for bad in ([], [-1], [10000000]):
        with pytest.raises(ValueError):
            llm.generate(PROMPT, SamplingParams(allowed_token_ids=bad))


# upstream: test_seed
def test_seed(llm: LLM) -> None:
    texts = [llm.generate(PROMPT, SamplingParams(seed=s), use_tqdm=False)[0].outputs[0].text
             for s in (42, 42, 43)]
    assert texts[0] == texts[1] and texts[0] != texts[2]
