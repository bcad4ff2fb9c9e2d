"""Programs whose contexts together overflow the KV pool (issue #19 at scale, on a tiny Llama):
later steps still prefill only their new tokens, outputs equal an unsqueezed run, pins are
taken back one by one rather than all at once, and the engine never idles while work waits."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from batchgen_data import LLM, Generate, SamplingParams, program
from batchgen_data.programs.offline import ProgramRunner
from engine_seams import watch_steps

pytestmark = pytest.mark.timeout(300)

BLOCK = 4
MAX_TOKENS = 6
FOLLOW_UP = [7, 8, 9, 10, 11, 12, 13, 14]  # a new turn: two full blocks


@program
def three_turns(row: dict[str, Any]) -> Any:
    """Each step's prompt is the previous prompt plus its reply plus a new turn, in tokens, so
    the only thing that can stop prefix reuse is KV that was not kept."""
    ids = list(row["ids"])
    cached = []
    for _ in range(3):
        r = yield Generate(prompt_token_ids=ids, temperature=0, max_tokens=MAX_TOKENS)
        cached.append((r.num_cached_tokens, len(ids)))
        ids = ids + r.token_ids + FOLLOW_UP
    return {"tokens": ids, "cached": cached}


def rows(n: int) -> list[dict[str, Any]]:
    # 20 distinct tokens per row: nothing shared between rows
    return [{"ids": [40 + (i * 7 + j * 3) % 200 for j in range(20)]} for i in range(n)]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[..., Path]) -> str:
    return str(tiny_model_dir("llama"))


def test_later_steps_reuse_their_conversation_when_the_pool_is_small(
        model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    data = rows(24)
    # a program peaks near 62 tokens (16 blocks): 24 of them need ~380 blocks; the pool has 64
    llm = LLM(model, max_model_len=128, max_num_seqs=16, block_size=BLOCK, num_kv_blocks=64)
    runner = ProgramRunner(llm.engine, three_turns)
    with monkeypatch.context() as m:
        shapes = watch_steps(llm.engine, m)
        outs = runner.run_all(data)
    assert all(s.num_seqs for s in shapes), "a step scheduled nothing while programs waited"
    assert not llm.engine.has_unfinished() and len(llm.engine.pins) == 0
    assert llm.engine.pins.num_blocks == 0 and llm.engine.pool.num_free == 64

    big = LLM(model, max_model_len=128, max_num_seqs=16, block_size=BLOCK)  # everything fits
    assert [o["tokens"] for o in outs] == [o["tokens"] for o in big.run(data, three_turns,
                                                                          use_tqdm=False)]
    # steps 2 and 3: the previous prompt and reply (but its last, never computed, token) were
    # kept, so at least their full blocks are hits
    reused = [o for o in outs
              if all(c >= (prev + MAX_TOKENS - 1) // BLOCK * BLOCK
                     for (c, _), (_, prev) in zip(o["cached"][1:], o["cached"][:-1]))]
    assert len(reused) >= 0.9 * len(data), [o["cached"] for o in outs]
    by_step = runner.stats.by_step
    assert by_step[2].steps == by_step[3].steps == len(data)
    assert by_step[3].hit_rate > 0.7, runner.stats.summary(llm.engine.pins)
    # bounded: not every program at once, but more than one
    assert 1 < runner.stats.max_in_flight < len(data)


def test_pins_are_taken_back_one_program_at_a_time(model: str) -> None:
    """With too many programs forced in at once, the scheduler takes back pins of the programs
    queued last, not all of them, and the run still completes with the same tokens."""
    from batchgen_data.programs.admission import PoolState, ProgramAdmission

    class Unbounded(ProgramAdmission):
        def may_start(self, pool: PoolState, held: dict[str, int]) -> bool:
            return True

    data = rows(16)
    llm = LLM(model, max_model_len=128, max_num_seqs=16, block_size=BLOCK, num_kv_blocks=64)
    runner = ProgramRunner(llm.engine, three_turns, admission=Unbounded(64, BLOCK))
    outs = runner.run_all(data)
    pins = llm.engine.pins
    assert pins.num_dropped > 0 and pins.num_dropped < pins.num_pinned
    assert not llm.engine.has_unfinished() and len(pins) == 0 and llm.engine.pool.num_free == 64
    big = LLM(model, max_model_len=128, max_num_seqs=16, block_size=BLOCK)
    assert [o["tokens"] for o in outs] == [o["tokens"] for o in big.run(data, three_turns,
                                                                          use_tqdm=False)]


def test_connector_programs_are_bounded_and_reuse_their_conversation(model: str) -> None:
    """The same squeeze through the path Ray and Spark share (DrivenPrograms over a driver)."""
    from batchgen_data.engine.driver import EngineDriver
    from batchgen_data.engine.engine import Engine
    from batchgen_data.programs.driven import DrivenPrograms

    data = rows(16)
    driver = EngineDriver(Engine.from_kwargs(model, max_model_len=128, max_num_seqs=16,
                                             block_size=BLOCK, num_kv_blocks=64))
    programs = DrivenPrograms(driver, three_turns)
    try:
        outs = [f.result(240) for f in [programs.submit(r) for r in data]]
        assert driver.call(lambda e: (len(e.pins), e.num_unfinished(), e.pool.num_free)
                           ).result(60) == (0, 0, 64)
    finally:
        programs.shutdown()
        driver.shutdown()
    big = LLM(model, max_model_len=128, max_num_seqs=16, block_size=BLOCK)
    assert [o["tokens"] for o in outs] == [o["tokens"] for o in big.run(data, three_turns,
                                                                          use_tqdm=False)]
    reused = [o for o in outs
              if all(c >= (prev + MAX_TOKENS - 1) // BLOCK * BLOCK
                     for (c, _), (_, prev) in zip(o["cached"][1:], o["cached"][:-1]))]
    assert len(reused) >= 0.9 * len(data), [o["cached"] for o in outs]
    assert 1 < programs.admission.max_in_flight < len(data)


def test_kv_blocks_held_counts_a_programs_pin_and_its_running_step_once(model: str) -> None:
    """What admission reads per program: its pinned blocks and its running step's blocks,
    the prefix they share counted once, so it matches what the pool has lent out."""
    llm = LLM(model, max_model_len=128, max_num_seqs=4, block_size=BLOCK, num_kv_blocks=64)
    engine = llm.engine
    ids = rows(1)[0]["ids"]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.submit(ids, sp, request_id="s1", pin="p")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    pinned = engine.kv_blocks_held("p")
    assert pinned == (len(ids) + MAX_TOKENS) // BLOCK == 64 - engine.pool.num_free
    engine.submit(ids + list(outs[0].outputs[0].token_ids) + FOLLOW_UP, sp, request_id="s2",
                  pin="p")
    assert engine.kv_blocks_held("p", ["s2"]) == pinned  # queued: it holds only the pin
    engine.step()  # its prompt is in, on top of the pinned prefix
    held = engine.kv_blocks_held("p", ["s2"])
    assert pinned < held == 64 - engine.pool.num_free
    assert engine.kv_blocks_held("q") == 0 and engine.kv_blocks_held("q", ["gone"]) == 0
    while engine.has_unfinished():
        engine.step()
    engine.unpin("p")
    assert engine.kv_blocks_held("p", ["s2"]) == 0 and engine.pool.num_free == 64
