"""Engine.prefix_summary and the prefix keys of waiting rows in Engine.movable, on a tiny random
Llama: after serving prompts, the summary holds exactly the keys of their cached full blocks at
the published depths (the oracle: keys recomputed from the token ids, cut where the scheduler
caches: every full block but the one holding the last prompt token)."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import pytest

from batchgen_data.engine.engine import Engine
from batchgen_data.placement import DEPTHS, chain_keys, prefix_keys
from batchgen_data.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Callable[..., Path]) -> Engine:
    return Engine.from_kwargs(str(tiny_model_dir("llama")), max_model_len=256, max_num_seqs=2)


def run_all(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_summary_holds_the_served_prefixes(engine: Engine) -> None:
    engine.reset_prefix_cache()
    bs = engine.pool.block_size
    rng = random.Random(0)
    docs = [[rng.randrange(10, 200) for _ in range(n)] for n in (5 * bs + 3, 2 * bs)]
    before = engine.prefix_summary("e1")
    assert before.engine_id == "e1" and before.keys == frozenset() and before.block_size == bs
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for doc in docs:
        engine.submit(doc, params)
    run_all(engine)
    want = set()
    for doc in docs:
        keys = chain_keys(doc[:len(doc) - 1], bs)  # the last prompt token is always computed
        want |= {keys[d - 1] for d in DEPTHS if d <= len(keys)}
    after = engine.prefix_summary("e1")
    # decoded tokens can fill a block too; the prompts' published keys must all be there and
    # nothing at an unpublished depth
    assert want <= after.keys and after.version != before.version
    assert len(after.keys) <= len(want) + 2
    assert engine.prefix_summary("e1").version == after.version  # nothing changed since
    engine.reset_prefix_cache()
    assert engine.prefix_summary().keys == frozenset()


def test_waiting_rows_carry_their_prefix_keys(engine: Engine) -> None:
    bs = engine.pool.block_size
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prompts = [[11 + i] * (3 * bs + i) for i in range(4)]
    rids = [engine.submit(p, params) for p in prompts]
    waiting = [r for r in engine.movable() if r.kind == "waiting"]
    assert [r.request_id for r in waiting] == rids
    assert [r.prefix for r in waiting] == [prefix_keys(p, bs) for p in prompts]
    run_all(engine)
