"""Port of vLLM's tests/v1/sample/test_logprobs.py (Llama-3.2-1B and opt-125m there, the tiny
random Llama here, HF's forward on the same weights as the oracle): logprobs and prompt logprobs
as vLLM returns them — dicts of `Logprob(logprob, rank, decoded_token)`, the sampled (or prompt)
token always present, every top-k rank present, `cumulative_logprob` their sum — for batches
mixing requests with and without them, greedy and sampled, with chunked prompts and with the
prefix cache; `max_logprobs`; `logprobs=0`, `None` and `-1`; `logprobs_mode`."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from batchgen_data import LLM, SamplingParams

ENGINE = dict(max_logprobs=7, max_num_batched_tokens=16, max_num_seqs=16, max_model_len=128)
PROMPTS = ["The quick brown fox jumps over the lazy dog.",
           "What is the capital of France?",
           "Write a short poem about the sea.",
           "def add(a, b):"]
MAX_TOKENS = 5
# upstream: tests/v1/sample/utils.py get_test_batch, (logprobs, prompt_logprobs) per request
BATCHES = {"NONE": [(None, None)],
           "SAMPLE": [(None, None), (0, None), (5, None), (3, None)],
           "PROMPT": [(None, None), (None, 0), (None, 6), (None, 5)],
           "SAMPLE_PROMPT": [(None, None), (0, None), (5, None), (3, None), (0, 3), (6, 0),
                             (6, 3), (None, 6), (None, 5), (None, 0)]}


@pytest.fixture(scope="module", params=[False, True], ids=["no-apc", "apc"])
def engine(model: str, request: pytest.FixtureRequest) -> LLM:
    return LLM(model, enable_prefix_caching=request.param, **ENGINE)


@pytest.fixture(scope="module")
def hf(model: str, hf_model: Callable[[Path], Any]) -> Any:
    return hf_model(Path(model))


@torch.no_grad()
def hf_greedy(hf: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """HF's greedy tokens, the log-softmax that chose each [MAX_TOKENS, V], and the prompt's
    teacher-forced log-softmax [P - 1, V] (row i predicts prompt token i + 1)."""
    ids = list(prompt)
    for _ in range(MAX_TOKENS):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    lp = torch.log_softmax(hf(torch.tensor([ids[:-1]])).logits[0].float(), -1)
    return ids[len(prompt):], lp[len(prompt) - 1:], lp[:len(prompt) - 1]


def alnum(text: str) -> str:
    """upstream: assert_incr_detok_str_matches_non_incr_detok_str compares only these."""
    return re.sub("[^a-zA-Z0-9]+", "", text)


def check_positions(entries: list[dict[int, Any]], tokens: list[int], k: int) -> None:
    for lps, tok in zip(entries, tokens):
        assert tok in lps  # the sampled (prompt) token is always there
        in_top = lps[tok].rank <= k
        assert len(lps) == (k if in_top and k != 0 else k + 1)
        assert {r for r in range(1, k + 1)} <= {lp.rank for lp in lps.values()}


def check_against(lps: dict[int, Any], chosen: int, row: torch.Tensor) -> None:
    """Every value is HF's log-softmax; the chosen token's rank is its place in HF's whole
    vocabulary, counted as vLLM does (1 + the tokens at least as likely, itself excluded)."""
    for t, lp in lps.items():
        assert lp.logprob == pytest.approx(row[t].item(), abs=1e-4)
    assert lps[chosen].rank == int((row >= row[chosen]).sum())


# upstream: test_get_logprobs_and_prompt_logprobs (and _run_and_validate)
@pytest.mark.parametrize("composition", list(BATCHES))
@pytest.mark.parametrize("temperature", [0.0, 2.0])
def test_get_logprobs_and_prompt_logprobs(engine: LLM, hf: Any, composition: str,
                                          temperature: float) -> None:
    apc = engine.engine.config.cache.enable_prefix_caching
    if apc and (temperature < 2.0 or composition != "SAMPLE_PROMPT"):
        pytest.skip("upstream runs one prefix-cache case")
    specs = [BATCHES[composition][i % len(BATCHES[composition])] for i in range(len(PROMPTS))]
    params = [SamplingParams(max_tokens=MAX_TOKENS, logprobs=lp, prompt_logprobs=plp,
                             temperature=temperature, seed=1984, ignore_eos=True)
              for lp, plp in specs]
    tok = engine.get_tokenizer()
    for _ in range(2 if apc else 1):  # the second pass reads the prefix cache
        results = engine.generate(PROMPTS, params, use_tqdm=False)
        for res, (num_lp, num_plp) in zip(results, specs):
            out = res.outputs[0]
            ref_tokens, ref_lp, ref_prompt_lp = hf_greedy(hf, res.prompt_token_ids)
            if temperature == 0.0:
                assert list(out.token_ids) == ref_tokens
            if num_lp is None:
                assert out.logprobs is None and out.cumulative_logprob is None
            else:
                assert len(out.logprobs) == MAX_TOKENS
                check_positions(out.logprobs, out.token_ids, num_lp)
                # a special token is text in its Logprob (vLLM decodes each alone) but not in
                # the output (skip_special_tokens); a random model does sample them
                decoded = "".join(next(iter(lps.values())).decoded_token
                                  for lps, t in zip(out.logprobs, out.token_ids)
                                  if tok.decode([t], skip_special_tokens=True))
                assert alnum(out.text) == alnum(decoded)
                for i, (lps, chosen) in enumerate(zip(out.logprobs, out.token_ids)):
                    for t, lp in lps.items():
                        assert isinstance(lp.decoded_token, str)
                        assert lp.decoded_token == tok.decode([t]) or "\ufffd" in tok.decode([t])
                    if temperature == 0.0 or i == 0:  # sampled runs part from HF after that
                        check_against(lps, chosen, ref_lp[i])
                assert out.cumulative_logprob == pytest.approx(
                    sum(lps[t].logprob for t, lps in zip(out.token_ids, out.logprobs)), abs=1e-6)
            if num_plp is None:
                assert res.prompt_logprobs is None
            else:
                plps = res.prompt_logprobs
                assert plps[0] is None and len(plps) == len(res.prompt_token_ids)
                check_positions(plps[1:], res.prompt_token_ids[1:], num_plp)
                for i, lps in enumerate(plps[1:]):
                    check_against(lps, res.prompt_token_ids[i + 1], ref_prompt_lp[i])


# upstream: test_max_logprobs
def test_max_logprobs(model: str) -> None:
    llm = LLM(model, max_logprobs=1, enable_prefix_caching=False, max_model_len=256)
    llm.generate(["Hello world"], SamplingParams(logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError):
        llm.generate(["Hello world"], SamplingParams(logprobs=2), use_tqdm=False)


# upstream: test_none_logprobs
def test_none_logprobs(engine: LLM) -> None:
    results = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                              use_tqdm=False)
    for res in results:
        assert res.outputs[0].logprobs is None and res.outputs[0].cumulative_logprob is None
        assert res.prompt_logprobs is None


# upstream: test_zero_logprobs
def test_zero_logprobs(engine: LLM) -> None:
    results = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, logprobs=0,
                                                      prompt_logprobs=0, temperature=0.0),
                              use_tqdm=False)
    for res in results:
        out = res.outputs[0]
        assert out.logprobs is not None and len(out.token_ids) == len(out.logprobs)
        assert out.cumulative_logprob is not None
        assert res.prompt_logprobs is not None
        assert len(res.prompt_token_ids) == len(res.prompt_logprobs)


# upstream: test_all_logprobs
def test_all_logprobs(model: str) -> None:
    llm = LLM(model, max_logprobs=-1, enable_prefix_caching=False, max_model_len=256)
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=5, logprobs=-1,
                                                   prompt_logprobs=-1), use_tqdm=False)
    vocab = llm.engine.vocab_size
    for res in results:
        assert all(len(lps) == vocab for lps in res.outputs[0].logprobs)
        assert all(len(lps) == vocab for lps in res.prompt_logprobs[1:])


# upstream: test_logprobs_mode. Only vLLM's default, raw_logprobs, is computed here; the
# other modes are refused by name (docs/vllm-compat.md)
def test_logprobs_mode(model: str) -> None:
    llm = LLM(model, max_logprobs=5, enable_prefix_caching=False, max_model_len=16,
              logprobs_mode="raw_logprobs")
    results = llm.generate(["Hello world"], SamplingParams(logprobs=1), use_tqdm=False)
    values = [lp.logprob for out in results[0].outputs for lps in out.logprobs
              for lp in lps.values()]
    assert len(values) >= len(results[0].outputs) and all(v <= 0 for v in values)
    for mode in ("raw_logits", "processed_logits", "processed_logprobs"):
        with pytest.raises(ValueError, match="logprobs_mode"):
            LLM(model, logprobs_mode=mode)
