"""Every SamplingParams field at its extremes, one at a time, through `LLM.generate` next to a
plain request (issue 57): each value is either refused where it enters, with the field named,
or runs to a normal output. Never a failed step, and the LLM answers the next call either way.

The oracle is the engine's own contract, checked from outside: an error must be a ValueError /
TypeError raised before anything runs (naming the field), and a request that ran must end with
a finish reason of "stop" or "length" and token ids inside the vocabulary."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import pytest

from batchgen_data import LLM, SamplingParams

ENGINE = dict(max_model_len=64, max_num_seqs=16, block_size=4)
BIG = [2**31, 2**62, 2**63, 2**64, 2**70]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[[str], Path]) -> str:
    return str(tiny_model_dir("llama"))


def extremes(vocab: int) -> list[tuple[str, Any]]:
    """(field, value) pairs: the edges of each field's range, and past them."""
    values: dict[str, list[Any]] = {
        "n": [1, 2, 40],
        "temperature": [0, 1e-300, 1e-6, 1e-5, 2, 1e30, 1e300, math.inf],
        "top_p": [1e-300, 1e-45, 1e-38, 1.0],
        "top_k": [-1, 1, vocab - 1, vocab, vocab + 1, *BIG],
        "min_p": [1e-300, 1e-45, 0.999999, 1.0],
        "min_tokens": [4, 5, 2**40],
        "stop": [["x" * 5000]],
        "stop_token_ids": [[0], [vocab - 1], [vocab], [2**63], [2**70]],
        "seed": [-(2**63) - 1, -(2**63), -1, 0, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**200],
        "logprobs": [0, 20, 21, vocab, vocab + 1, 100000, 2**63],
        "prompt_logprobs": [0, 20, 21, vocab, vocab + 1, 100000, 2**63],
        "repetition_penalty": [1e-300, 1e-45, 1e-30, 2.0**-64, 1e-19, 1e19, 2.0**64, 1e30,
                               1e300, math.inf],
        "presence_penalty": [-2, 2],
        "frequency_penalty": [-2, 2],
        "logit_bias": [{0: 1e300}, {0: -math.inf}, {2**70: 1.0},
                       {i: 100.0 for i in range(vocab)}, {i: -100.0 for i in range(vocab)}],
        "allowed_token_ids": [[0], [vocab - 1], [vocab], [2**70]],
        "bad_words": [["x" * 3000]],
        "truncate_prompt_tokens": [1, 2**70],
        "max_tokens": [1, 63, 64, 2**70],
    }
    return [(name, v) for name, vs in values.items() for v in vs]


def test_every_sampling_field_at_its_extremes_is_refused_by_name_or_runs(model: str) -> None:
    llm = LLM(model, **ENGINE)
    vocab = llm.engine.vocab_size
    plain = SamplingParams(max_tokens=4)
    refused, ran = [], []
    for name, value in extremes(vocab):
        kw: dict[str, Any] = {"max_tokens": 4, "temperature": 0.8, name: value}
        if name == "temperature":
            kw.pop("temperature")
            kw[name] = value
        where = f"{name}={str(value)[:40]}"
        try:
            params = SamplingParams(**kw)
        except (ValueError, TypeError) as e:
            assert name in str(e), f"{where}: refused without naming the field: {e}"
            refused.append(where)
            continue
        try:
            outs = llm.generate(["hello world", "the quick brown fox"], [plain, params],
                                use_tqdm=False)
        except (ValueError, TypeError) as e:
            assert name in str(e) and str(e).startswith("prompts[1]: "), \
                f"{where}: not an entry check naming the field: {type(e).__name__}: {e}"
            refused.append(where)
        else:
            for out in outs:
                for c in out.outputs:
                    assert c.finish_reason in ("stop", "length"), f"{where}: {c}"
                    assert all(0 <= t < vocab for t in c.token_ids), f"{where}: {c.token_ids}"
            ran.append(where)
        # the engine is alive and clean: the next call runs
        after = llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0),
                             use_tqdm=False)
        assert after[0].outputs[0].finish_reason in ("stop", "length"), where
    # both kinds happen: the bounds are reached from each side
    assert "logprobs=100000" in refused and "seed=18446744073709551616" in refused
    assert "repetition_penalty=1e-300" in refused and f"top_k={2**70}" in ran
    assert "seed=18446744073709551615" in ran and "logprobs=20" in ran


def test_max_logprobs_is_the_engine_argument(model: str) -> None:
    """vLLM's `max_logprobs`: the limit itself (20 by default, -1: the vocabulary)."""
    llm = LLM(model, max_logprobs=-1, **ENGINE)
    vocab = llm.engine.vocab_size
    out = llm.generate(["hello"], SamplingParams(max_tokens=2, logprobs=vocab,
                                                 prompt_logprobs=vocab), use_tqdm=False)[0]
    assert all(len(d) == vocab for d in out.outputs[0].logprobs)
    with pytest.raises(ValueError, match=r"prompts\[0\]: SamplingParams.logprobs=.*greater "
                                         r"than max allowed: " + str(vocab)):
        llm.generate(["hello"], SamplingParams(logprobs=vocab + 1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs=-2"):
        LLM(model, max_logprobs=-2, **ENGINE)


def test_seed_is_its_64_bit_value(model: str) -> None:
    """A seed past 2**63 runs as its two's complement, as torch.manual_seed takes it: -2 and
    2**64 - 2 sample the same tokens (-1 is vLLM's "no seed")."""
    llm = LLM(model, **ENGINE)
    outs = llm.generate(["hello"] * 3, [SamplingParams(max_tokens=8, temperature=1.0, seed=s)
                                        for s in (-2, 2**64 - 2, 7)], use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    assert toks[0] == toks[1] and toks[0] != toks[2]
