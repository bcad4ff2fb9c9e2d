"""The SamplingParams fields beyond the basics — logit_bias, allowed_token_ids, bad_words,
prompt_logprobs, truncate_prompt_tokens, detokenize — against HF where HF has an oracle:
`generate(sequence_bias=)`, `generate(prefix_allowed_tokens_fn=)`, `generate(bad_words_ids=)`,
and log_softmax of HF's forward logits."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from batchgen_data import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 9, 33, 21], [100, 3, 77], list(range(20, 50))]


@pytest.fixture(scope="module")
def path(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(path: Path) -> LLM:
    return LLM(str(path), block_size=4)


@pytest.fixture(scope="module")
def hf(path: Path, hf_model: Callable[[Path], Any]) -> Any:
    return hf_model(path)


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 10), ignore_eos=True, **kw)


def ours(llm: LLM, sp: SamplingParams, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def hf_greedy(hf: Any, prompt: list[int], max_tokens: int = 10, **kw: Any) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                      do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def test_logit_bias_matches_hf_sequence_bias(llm: LLM, hf: Any) -> None:
    plain = ours(llm, greedy())
    # push down every row's first greedy token, lift two others
    bias = {row[0]: -100.0 for row in plain} | {11: 4.0, 250: 6.5}
    got = ours(llm, greedy(logit_bias=bias))
    assert got != plain
    want = [hf_greedy(hf, p, sequence_bias={(t,): b for t, b in bias.items()}) for p in PROMPTS]
    assert got == want


def test_allowed_token_ids_match_hf_prefix_constraint(llm: LLM, hf: Any) -> None:
    allowed = [7, 19, 64, 130, 301]
    got = ours(llm, greedy(allowed_token_ids=allowed))
    want = [hf_greedy(hf, p, prefix_allowed_tokens_fn=lambda _b, _ids: allowed) for p in PROMPTS]
    assert got == want
    # classification: one greedy token is the argmax of HF's logits over the allowed set
    logits = hf(torch.tensor([PROMPTS[0]])).logits[0, -1]
    assert got[0][0] == allowed[int(logits[allowed].argmax())]
    sampled = ours(llm, SamplingParams(temperature=1.5, seed=3, max_tokens=30, ignore_eos=True,
                                       allowed_token_ids=allowed))
    drawn = {t for row in sampled for t in row}
    assert drawn <= set(allowed) and len(drawn) > 1


def test_bad_words_match_hf_bad_words_ids(llm: LLM, hf: Any) -> None:
    plain = ours(llm, greedy(max_tokens=12))
    tok = llm.tokenizer
    words = [tok.decode([plain[0][0]]), tok.decode([plain[2][1]])]
    spellings = llm.engine.sampler.bad_words.spellings(words)
    assert any(len(s) > 1 for s in spellings)  # the spaced spelling of a word is two tokens here
    # vLLM (and this engine) match the output only, HF the prompt too: keep prompts clear of it
    assert all(p[-1] != s[0] for p in PROMPTS for s in spellings if len(s) > 1)
    got = ours(llm, greedy(max_tokens=12, bad_words=words))
    assert got != plain
    for row in got:
        for s in spellings:
            assert all(row[i:i + len(s)] != s for i in range(len(row)))
    assert got == [hf_greedy(hf, p, 12, bad_words_ids=spellings) for p in PROMPTS]


def hf_prompt_logprobs(hf: Any, prompt: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)  # [P, V]


def check_prompt_logprobs(entries: list[dict[int, float] | None] | None, prompt: list[int],
                          ref: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        row = ref[i - 1]
        e = entries[i]
        assert e[prompt[i]] == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        top = row.topk(k).indices.tolist()
        assert set(top) <= set(e) and len(e) <= k + 1
        for t in top:
            assert e[t] == pytest.approx(row[t].item(), abs=1e-4)


@pytest.mark.parametrize("engine_kw", [dict(block_size=4),  # prompts chunked over many steps
                                       dict(block_size=4, max_num_batched_tokens=7)])
def test_prompt_logprobs_match_hf_forward(path: Path, hf: Any, engine_kw: dict) -> None:
    llm = LLM(str(path), **engine_kw)
    base = greedy(max_tokens=6)
    plain = ours(llm, base)  # every prompt's full blocks are now in the prefix cache
    hits = llm.engine.pool.hits
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[2]]
    sps = [greedy(max_tokens=6, prompt_logprobs=3), base, greedy(max_tokens=6, prompt_logprobs=0)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    # the row without prompt_logprobs hit the cache; the others computed every position
    assert llm.engine.pool.hits - hits == (len(PROMPTS[2]) - 1) // 4
    assert [o.num_cached_tokens for o in outs] == [0, (len(PROMPTS[2]) - 1) // 4 * 4, 0]
    for i, k in ((0, 3), (2, 0)):
        ref = hf_prompt_logprobs(hf, prompts[i])
        check_prompt_logprobs(outs[i].prompt_logprobs, prompts[i], ref, k)
    assert outs[1].prompt_logprobs is None
    assert [o.outputs[0].token_ids for o in outs] == [plain[0], plain[2], plain[2]]


def test_prompt_logprobs_survive_preemption_and_export(path: Path, hf: Any) -> None:
    prompt = PROMPTS[2]
    ref = hf_prompt_logprobs(hf, prompt)
    small = LLM(str(path), num_kv_blocks=14, block_size=4, preemption_mode="recompute")
    sps = [greedy(max_tokens=24, prompt_logprobs=1, n=1)] + [greedy(max_tokens=24)] * 2
    outs = small.generate([{"prompt_token_ids": p} for p in [prompt] + PROMPTS[:2]], sps,
                          use_tqdm=False)
    assert small.engine.stats.num_preemptions > 0
    check_prompt_logprobs(outs[0].prompt_logprobs, prompt, ref, 1)
    # export mid-prompt (no KV), continue in another engine: the entries line up
    a = LLM(str(path), block_size=4, max_num_batched_tokens=8).engine
    b = LLM(str(path), block_size=4).engine
    rid = a.submit(prompt, greedy(max_tokens=4, prompt_logprobs=2))
    a.step()
    state = a.export(rid)
    assert 1 < len(state["seqs"][0]["prompt_logprobs"]) < len(prompt)
    b.import_(state)
    done = []
    while b.has_unfinished():
        done += b.step()
    check_prompt_logprobs(done[0].prompt_logprobs, prompt, ref, 2)


def test_prompt_logprobs_with_n_are_reported_once(llm: LLM, hf: Any) -> None:
    out = llm.generate({"prompt_token_ids": PROMPTS[1]},
                       SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=4,
                                      prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3
    check_prompt_logprobs(out.prompt_logprobs, PROMPTS[1], hf_prompt_logprobs(hf, PROMPTS[1]), 1)


def test_truncate_prompt_tokens_equals_the_truncated_prompt(path: Path) -> None:
    llm = LLM(str(path), block_size=4, max_model_len=24)
    long = PROMPTS[2]  # 30 tokens: longer than max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": long}, greedy(max_tokens=3), use_tqdm=False)
    cut = llm.generate({"prompt_token_ids": long}, greedy(max_tokens=3, truncate_prompt_tokens=5),
                       use_tqdm=False)[0]
    assert cut.prompt_token_ids == long[-5:]
    assert cut.outputs[0].token_ids == ours(llm, greedy(max_tokens=3), [long[-5:]])[0]
    fit = llm.generate({"prompt_token_ids": long}, greedy(max_tokens=3, truncate_prompt_tokens=-1),
                       use_tqdm=False)[0]
    assert fit.prompt_token_ids == long[-23:] and len(fit.outputs[0].token_ids) == 1  # room: 1
    assert fit.outputs[0].token_ids == ours(llm, greedy(max_tokens=3), [long[-23:]])[0]


def test_detokenize_false_returns_tokens_only(llm: LLM) -> None:
    on = llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy(), use_tqdm=False)[0].outputs[0]
    off = llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy(detokenize=False),
                       use_tqdm=False)[0].outputs[0]
    assert on.text and off.text == "" and off.token_ids == on.token_ids


def test_request_checks_that_need_the_model(llm: LLM) -> None:
    vocab = llm.engine.vocab_size
    for sp, field in ((greedy(allowed_token_ids=[1, vocab]), "allowed_token_ids"),
                      (greedy(logit_bias={vocab + 3: 1.0}), "logit_bias")):
        with pytest.raises(ValueError, match=field):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, sp, use_tqdm=False)
    best = SamplingParams(n=2, best_of=2, temperature=1.0, seed=1, max_tokens=3)
    assert len(llm.generate({"prompt_token_ids": PROMPTS[0]}, best, use_tqdm=False)[0].outputs) == 2
