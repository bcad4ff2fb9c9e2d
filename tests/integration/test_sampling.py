"""Each sampling parameter does what vLLM's does, on a tiny model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from batchgen_data.sample.sampler import hash_uniform


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


@pytest.fixture(scope="module")
def eos_model(tiny_model_dir, tmp_path_factory, llm: LLM) -> tuple[Path, int, int]:  # type: ignore[no-untyped-def]
    """The tiny llama with an extra EOS in its generation config: the token greedy decoding
    emits at step k >= 3 of the first prompt (the first token not seen before in that row), so
    that greedy decoding really reaches EOS. Returns (model dir, that token, k)."""
    ref = toks(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    k = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i] and ref[i] > 2)
    dst = tmp_path_factory.mktemp("tiny-llama-eos")
    for f in Path(tiny_model_dir("llama")).iterdir():
        shutil.copy(f, dst / f.name)
    gen = json.loads((dst / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, ref[k]]
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst, ref[k], k


def test_eos_from_generation_config_stops_like_hf(eos_model, hf_model) -> None:  # type: ignore[no-untyped-def]
    path, eos, k = eos_model
    llm = LLM(str(path))
    hf = hf_model(path)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    stopped = 0
    for p, o in zip(PROMPTS, out):
        ids = torch.tensor([p["prompt_token_ids"]])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                           do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
        c = o.outputs[0]
        assert c.token_ids == want
        if c.token_ids[-1] == eos:
            stopped += 1
            assert c.finish_reason == "stop" and c.stop_reason is None
            assert len(c.token_ids) < 12 and eos not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 12
    assert stopped >= 1 and len(out[0].outputs[0].token_ids) == k + 1  # the first row, at step k
    ignored = toks(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [len(t) for t in ignored] == [12] * len(PROMPTS)
    assert ignored[0][:k + 1] == out[0].outputs[0].token_ids


def test_stop_strings_truncate_exactly(llm: LLM) -> None:
    full = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    # a needle that first occurs at a known, non-zero offset of the greedy text
    at = next(i for i in range(1, len(full) - 3) if full.find(full[i:i + 3]) == i
              and full[i:i + 3].strip())
    needle = full[at:at + 3]
    for include in (False, True):
        c = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                     stop=[needle], include_stop_str_in_output=include),
                         use_tqdm=False)[0].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == needle
        assert c.text == full[:at + (3 if include else 0)], include
        # generation ended on the token that completed the needle
        done = llm.tokenizer.decode(c.token_ids)
        assert needle in done and needle not in llm.tokenizer.decode(c.token_ids[:-1])


def test_skip_special_tokens_in_text_and_stop_strings(llm: LLM) -> None:
    tok = llm.tokenizer
    start = tok.convert_tokens_to_ids("<|im_start|>")
    # sample among a special token and a few plain ones, so the output mixes both
    allowed = [start, 50, 60, 70, 80]
    kw = dict(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed)
    shown, hidden = (llm.generate(PROMPTS[:1], SamplingParams(skip_special_tokens=skip, **kw),
                                  use_tqdm=False)[0].outputs[0] for skip in (False, True))
    assert shown.token_ids == hidden.token_ids and start in shown.token_ids[1:]
    assert shown.text == tok.decode(shown.token_ids, skip_special_tokens=False)
    assert hidden.text == tok.decode(shown.token_ids, skip_special_tokens=True)
    assert "<|im_start|>" in shown.text and "<|im_start|>" not in hidden.text
    first = shown.token_ids.index(start)
    # a stop string made of the special token's text matches only when it is not skipped
    seen = llm.generate(PROMPTS[:1], SamplingParams(skip_special_tokens=False, stop=["<|im_start|>"],
                                                    **kw), use_tqdm=False)[0].outputs[0]
    assert seen.token_ids == shown.token_ids[:first + 1] and seen.finish_reason == "stop"
    assert seen.text == tok.decode(shown.token_ids[:first], skip_special_tokens=False)
    unseen = llm.generate(PROMPTS[:1], SamplingParams(stop=["<|im_start|>"], **kw),
                          use_tqdm=False)[0].outputs[0]
    assert unseen.token_ids == shown.token_ids and unseen.finish_reason == "length"


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
