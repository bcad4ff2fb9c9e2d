"""Independent oracles for logprobs, penalties and prefix caching, on the tiny llama.

Logprobs are compared with log_softmax of HF's own forward logits; the repetition penalty with
HF `generate(repetition_penalty=)`; frequency and presence penalties with a greedy loop that
applies OpenAI's formula by hand to HF's logits. Nothing here is checked against the engine
itself.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from batchgen_data import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 9, 33, 21], [100, 3, 77], list(range(20, 50))]
STEPS = 12


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
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **kw)


@torch.no_grad()
def hf_logprobs(hf: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: log_softmax of HF's logits at each position that predicted an output."""
    ids = torch.tensor([prompt + output[:-1]])
    logits = hf(ids).logits[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits, -1)


@torch.no_grad()
def hf_greedy_by_hand(hf: Any, prompt: list[int], frequency: float, presence: float) -> list[int]:
    """Greedy decoding with OpenAI's penalties applied to HF's logits: subtract
    frequency * count + presence * (count > 0), counting output tokens only."""
    out: list[int] = []
    for _ in range(STEPS):
        logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long),
                                minlength=logits.shape[0]).float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        out.append(int(logits.argmax()))
    return out


def test_logprobs_equal_log_softmax_of_hf_logits(llm: LLM, hf: Any) -> None:
    k = 4
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(logprobs=k),
                        use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        c = o.outputs[0]
        ref = hf_logprobs(hf, p, c.token_ids)  # [STEPS, V]
        assert len(c.logprobs) == STEPS
        for step, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[step]
            assert tok == int(row.argmax())
            top = row.topk(k)
            assert set(lp) == set(top.indices.tolist())  # greedy: the chosen token is in the top k
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert lp[t] == pytest.approx(v, abs=1e-4), (step, t)
    # sampled tokens: the logprob reported for a token outside the top k is still HF's
    hot = llm.generate({"prompt_token_ids": PROMPTS[1]},
                       SamplingParams(temperature=2.0, seed=9, max_tokens=STEPS, ignore_eos=True,
                                      logprobs=1), use_tqdm=False)[0].outputs[0]
    ref = hf_logprobs(hf, PROMPTS[1], hot.token_ids)
    assert any(tok != int(ref[i].argmax()) for i, tok in enumerate(hot.token_ids))
    for i, (tok, lp) in enumerate(zip(hot.token_ids, hot.logprobs)):
        assert lp[tok] == pytest.approx(ref[i, tok].item(), abs=1e-4)


# Every penalty variant runs in one generate() call (one engine pass for all of them).
VARIANTS = [dict(repetition_penalty=1.8), dict(repetition_penalty=0.6),
            dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
            # small or negative: tokens still repeat, so a count grows past one and presence
            # (once per token) and frequency (per occurrence) give different tokens
            dict(presence_penalty=0.3), dict(presence_penalty=-0.5),
            dict(frequency_penalty=0.7, presence_penalty=0.9)]


def test_penalties_match_hf_token_for_token(llm: LLM, hf: Any) -> None:
    rows = [(v, p) for v in VARIANTS for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for _, p in rows] + [{"prompt_token_ids": p}
                                                                      for p in PROMPTS],
                        [greedy(**v) for v, _ in rows] + [greedy()] * len(PROMPTS), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs[:len(rows)]]
    plain = [o.outputs[0].token_ids for o in outs[len(rows):]]
    for (v, p), tokens in zip(rows, got):
        if "repetition_penalty" in v:
            ids = torch.tensor([p])
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS,
                               do_sample=False, eos_token_id=None, pad_token_id=0,
                               repetition_penalty=v["repetition_penalty"])[0, len(p):].tolist()
        else:
            want = hf_greedy_by_hand(hf, p, v.get("frequency_penalty", 0.0),
                                     v.get("presence_penalty", 0.0))
        assert tokens == want, v
    # each variant changes at least one row, so the comparison above is not a greedy re-run
    for i, v in enumerate(VARIANTS):
        assert got[i * len(PROMPTS):(i + 1) * len(PROMPTS)] != plain, v


def test_num_cached_tokens_is_exact(path: Path) -> None:
    long = PROMPTS[2]  # 30 tokens, block_size 4
    shares = long[:13] + [7, 8, 9]  # a 13-token common prefix: 3 full blocks
    for caching, want in ((True, [0, 28, 12]), (False, [0, 0, 0])):
        llm = LLM(str(path), block_size=4, enable_prefix_caching=caching)
        first = llm.generate({"prompt_token_ids": long}, greedy(), use_tqdm=False)[0]
        again, other = llm.generate([{"prompt_token_ids": long}, {"prompt_token_ids": shares}],
                                    greedy(), use_tqdm=False)
        # the last prompt token is always computed, so a 30-token prompt reuses 7 blocks of 4
        assert [first.num_cached_tokens, again.num_cached_tokens,
                other.num_cached_tokens] == want, caching
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        if not caching:
            assert llm.engine.pool.hits == 0
