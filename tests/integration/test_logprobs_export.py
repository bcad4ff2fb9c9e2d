"""Logprobs of a request moved between engines mid-generation (export / import, as migration
and engine groups do): the state carries them as plain data (it pickles to lists and numbers
only), and the moved request's `Logprob` dicts and `cumulative_logprob` equal an unmoved run's.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Callable

import pytest

from batchgen_data import SamplingParams
from batchgen_data.engine.engine import Engine

PROMPT = [7, 8, 9, 10, 11, 12, 13]
PARAMS = SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)


def finish(engine: Engine) -> object:
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs[-1]


def plain(value: object) -> bool:
    """Only the builtin containers and scalars of plain data, all the way down."""
    if isinstance(value, (list, tuple)):
        return all(plain(v) for v in value)
    if isinstance(value, dict):
        return all(plain(k) and plain(v) for k, v in value.items())
    return value is None or type(value) in (int, float, str, bool)


def test_moved_request_keeps_its_logprobs(tiny_model_dir: Callable[[str], Path]) -> None:
    path = str(tiny_model_dir("llama"))
    src, dst = (Engine.from_kwargs(path, max_model_len=128) for _ in range(2))
    ref = src.submit(PROMPT, PARAMS, request_id="ref")
    want = finish(src)
    assert want.request_id == ref
    rid = src.submit(PROMPT, PARAMS, request_id="moved")
    for _ in range(5):
        src.step()
    state = src.export(rid)
    seq = state["seqs"][0]
    assert 0 < len(seq["logprobs"]) < PARAMS.max_tokens and plain(seq["logprobs"])
    assert plain(seq["prompt_logprobs"])
    dst.import_(pickle.loads(pickle.dumps(state)))
    got = finish(dst)
    a, b = got.outputs[0], want.outputs[0]
    assert a.token_ids == b.token_ids and got.prompt_logprobs == want.prompt_logprobs
    assert len(a.logprobs) == len(b.logprobs) == PARAMS.max_tokens
    # the importing engine recomputes the prefix in one prefill, not step by step: values agree
    # to float32 rounding; ids, order, ranks and texts exactly
    for x, y in zip(a.logprobs, b.logprobs):
        assert list(x) == list(y)
        assert [(lp.rank, lp.decoded_token) for lp in x.values()] == \
            [(lp.rank, lp.decoded_token) for lp in y.values()]
        assert [lp.logprob for lp in x.values()] == pytest.approx([lp.logprob for lp in y.values()],
                                                                   abs=1e-5)
    assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
    assert all(lp.decoded_token is not None and lp.rank >= 1
               for lps in a.logprobs for lp in lps.values())
