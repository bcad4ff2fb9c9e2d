"""Each sampling parameter does what vLLM's does, on a tiny model."""
from __future__ import annotations

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from batchgen_data.engine.sampler import hash_uniform


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(tiny_model_dir("llama")))


PROMPTS = [{"prompt_token_ids": [5, 17, 42, 9]}, {"prompt_token_ids": [100, 3, 77]},
           {"prompt_token_ids": list(range(20, 50))}]


def toks(llm: LLM, sp: SamplingParams, prompts=PROMPTS) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_seeded_sampling_is_independent_of_batch(llm: LLM) -> None:
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    alone = toks(llm, sp, PROMPTS[:1])[0]
    together = toks(llm, sp, PROMPTS)[0]
    other_mix = llm.generate(PROMPTS[:1] + PROMPTS[2:],
                             [sp, SamplingParams(temperature=0.5, max_tokens=30, ignore_eos=True)],
                             use_tqdm=False)[0].outputs[0].token_ids
    assert alone == together == other_mix
    assert toks(llm, SamplingParams(temperature=1.0, seed=12, max_tokens=12, ignore_eos=True),
                PROMPTS[:1])[0] != alone


def test_truncation_to_one_token_equals_greedy(llm: LLM) -> None:
    greedy = toks(llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        sp = SamplingParams(temperature=1.5, seed=3, max_tokens=8, ignore_eos=True, **kw)
        assert toks(llm, sp) == greedy, kw


def test_high_temperature_differs_from_greedy(llm: LLM) -> None:
    greedy = toks(llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    hot = toks(llm, SamplingParams(temperature=2.0, seed=1, max_tokens=8, ignore_eos=True))
    assert hot != greedy


def test_penalties_reduce_repetition(llm: LLM) -> None:
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = toks(llm, base)
    for kw in (dict(repetition_penalty=2.0), dict(frequency_penalty=2.0), dict(presence_penalty=2.0)):
        pen = toks(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **kw))
        assert sum(len(set(t)) for t in pen) > sum(len(set(t)) for t in plain), kw


def test_stop_token_ids_min_tokens_and_max_tokens(llm: LLM) -> None:
    ref = toks(llm, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), PROMPTS[:1])[0]
    stop_at = ref[3]
    first = ref.index(stop_at)
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                   stop_token_ids=[stop_at]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.token_ids == ref[:first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_at
    late = toks(llm, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, min_tokens=first + 2,
                                    stop_token_ids=[stop_at]), PROMPTS[:1])[0]
    assert len(late) > first + 1 and stop_at not in late[:first + 2]
    length = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert len(length.token_ids) == 4 and length.finish_reason == "length"


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    eos = llm.tokenizer.eos_token_id
    ref = toks(llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    row = next((i for i, t in enumerate(ref) if eos in t), None)
    if row is None:
        pytest.skip("tiny model never produces EOS greedily")
    out = toks(llm, SamplingParams(temperature=0, max_tokens=40))[row]
    assert out[-1] == eos and len(out) == ref[row].index(eos) + 1


def test_stop_strings_trim_text(llm: LLM) -> None:
    full = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    needle = full[4:7]
    if not needle.strip():
        pytest.skip("decoded text has no usable substring")
    c = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                 stop=[needle]), use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == needle
    assert needle not in c.text and full.startswith(c.text)


def test_logprobs_and_n(llm: LLM) -> None:
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                   ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) >= 3
        assert lp[tok] == pytest.approx(max(lp.values()))  # greedy picks the top token
    many = llm.generate(PROMPTS[:1], SamplingParams(n=3, temperature=1.5, seed=4, max_tokens=8,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert len(many.outputs) == 3 and len({tuple(c.token_ids) for c in many.outputs}) > 1


def test_hash_uniform_is_uniform_and_deterministic() -> None:
    u = hash_uniform(torch.tensor([1, 2]), torch.tensor([0, 0]), 50000)
    assert torch.equal(u, hash_uniform(torch.tensor([1, 2]), torch.tensor([0, 0]), 50000))
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and not torch.equal(u[0], u[1])
