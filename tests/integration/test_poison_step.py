"""A step that fails for one row fails that row alone (issue 57, engine/step_failure.py): the
poisoned request ends with finish_reason "error" and the reason, every other request runs on
with HF generate's greedy tokens (seeded ones with an unpoisoned run's), the KV blocks all come
back, and the engine takes the next request. A failure no row causes (a lost device, a row
alone in its step) is still the engine's, naming the step's requests as suspects."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from batchgen_data.engine.driver import EngineDriver, RequestFailedError
from batchgen_data.engine.engine import Engine
from batchgen_data.engine.step_failure import StepError, request_error

from poison_engine import MESSAGE, POISON, poisoned_engine

ENGINE = dict(max_model_len=64, max_num_seqs=16, block_size=4, device="cpu")
PROMPTS = [[5, 17, 42, 9, 33], [100, 3, 77], [20, 21, 22, POISON, 23], [40, 41, 43],
           [50, 51, 52, 53, 54, 55], [60, 61]]
BAD = 2
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def hf_tokens(path: Path, hf_model: Callable[[Path], Any]) -> list[list[int]]:
    hf = hf_model(path)
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def run_all(engine: Engine, params: Any, prompts: list[list[int]] = PROMPTS) -> list[Any]:
    ps = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.submit(p, sp) for p, sp in zip(prompts, ps)]
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    return [outs[i] for i in ids]


# a budget of 6 tokens a step admits the prompts over several steps: under async_scheduling the
# poisoned one then first enters a step built while the one before runs (the look-ahead)
@pytest.mark.parametrize("where,async_scheduling,budget", [
    ("run", False, 2048), ("launch", False, 2048), ("launch", True, 2048),
    ("batch", True, 2048), ("launch", True, 6), ("batch", True, 6)])
def test_the_poisoned_row_fails_alone_and_the_others_keep_hf_tokens(
        path: Path, hf_tokens: list[list[int]], where: str, async_scheduling: bool,
        budget: int) -> None:
    engine = poisoned_engine(str(path), where, async_scheduling=async_scheduling,
                             max_num_batched_tokens=budget, **ENGINE)
    free = engine.pool.num_free
    outs = run_all(engine, GREEDY)
    for i, (out, want) in enumerate(zip(outs, hf_tokens)):
        c = out.outputs[0]
        if i == BAD:
            assert c.finish_reason == "error" and MESSAGE in c.stop_reason
            assert request_error(out) == c.stop_reason
        else:
            assert request_error(out) is None and c.finish_reason == "length"
            assert c.token_ids == want, i
    # nothing of the failed step stays behind: every block is back, nothing is live
    assert engine.pool.num_free == free and not engine.has_unfinished()
    assert engine.stats.num_failed == 1
    # and the engine takes the next request
    assert run_all(engine, GREEDY, [PROMPTS[0]])[0].outputs[0].token_ids == hf_tokens[0]


def test_seeded_rows_sample_what_an_unpoisoned_run_samples(path: Path) -> None:
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=10,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    params[1] = SamplingParams(temperature=0.7, n=3, seed=9, max_tokens=10, ignore_eos=True)
    want = run_all(Engine.from_kwargs(str(path), **ENGINE), params)
    got = run_all(poisoned_engine(str(path), "run", **ENGINE), params)
    for i, (g, w) in enumerate(zip(got, want)):
        if i != BAD:
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs], i


def test_every_sample_of_a_poisoned_request_and_two_poisoned_rows(path: Path,
                                                                  hf_tokens: list[list[int]]
                                                                  ) -> None:
    prompts = PROMPTS + [[POISON, 90, 91]]
    params = [GREEDY] * len(prompts)
    params[BAD] = SamplingParams(temperature=0.8, n=3, max_tokens=8, ignore_eos=True)
    engine = poisoned_engine(str(path), "run", **ENGINE)
    outs = run_all(engine, params, prompts)
    assert [c.finish_reason for c in outs[BAD].outputs] == ["error"] * 3
    assert outs[-1].outputs[0].finish_reason == "error"
    for i in range(len(PROMPTS)):
        if i != BAD:
            assert outs[i].outputs[0].token_ids == hf_tokens[i]
    assert engine.stats.num_failed == 2


def test_a_poisoned_row_alone_in_its_step_is_the_engines_failure(path: Path) -> None:
    """No other row runs to show the device works, and the row fails with neutral sampling
    values too: nothing tells the row from the device, so the engine fails, naming it."""
    engine = poisoned_engine(str(path), "run", **ENGINE)
    rid = engine.submit(PROMPTS[BAD], GREEDY)
    with pytest.raises(StepError, match=MESSAGE) as err:
        run_all(engine, GREEDY, [])
    assert err.value.suspects == (rid,)


def test_a_lost_device_is_the_engines_failure_with_the_step_as_suspects(path: Path) -> None:
    engine = poisoned_engine(str(path), "run", kills_device=True, **ENGINE)
    with pytest.raises(StepError, match="no single request is at fault") as err:
        run_all(engine, GREEDY)
    assert set(err.value.suspects) == {f"req-{i}" for i in range(len(PROMPTS))}


def test_a_sampling_failure_alone_in_its_step_is_the_rows(path: Path) -> None:
    """Alone in its step, a row whose sampling fails while the same row runs greedily with no
    logprobs (the neutral control) is blamed: the model and the device work."""
    engine = poisoned_engine(str(path), "draw", **ENGINE)
    out = run_all(engine, SamplingParams(temperature=0.8, max_tokens=4), [PROMPTS[BAD]])[0]
    assert out.outputs[0].finish_reason == "error" and MESSAGE in out.outputs[0].stop_reason
    assert run_all(engine, GREEDY, [PROMPTS[0]])[0].outputs[0].finish_reason == "length"


def test_the_driver_fails_the_rows_future_and_runs_on(path: Path,
                                                       hf_tokens: list[list[int]]) -> None:
    driver = EngineDriver(poisoned_engine(str(path), "run", **ENGINE))
    try:
        futures = [driver.submit(p, GREEDY) for p in PROMPTS]
        for i, (fut, want) in enumerate(zip(futures, hf_tokens)):
            if i == BAD:
                with pytest.raises(RequestFailedError, match=MESSAGE):
                    fut.result(timeout=60)
            else:
                assert fut.result(timeout=60).outputs[0].token_ids == want
        assert driver.dead is None
        assert driver.submit(PROMPTS[0], GREEDY).result(timeout=60).outputs[0].token_ids \
            == hf_tokens[0]
    finally:
        driver.shutdown()


def test_llm_returns_the_error_row_and_stays_usable(path: Path,
                                                    hf_tokens: list[list[int]]) -> None:
    llm = LLM._over(poisoned_engine(str(path), "run", **ENGINE))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs].count("error") == 1
    assert outs[BAD].outputs[0].finish_reason == "error"
    # a poisoned row alone is the engine's failure: raised, and the LLM is clean afterwards
    with pytest.raises(StepError):
        llm.generate([{"prompt_token_ids": PROMPTS[BAD]}], GREEDY, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    assert again[0].outputs[0].token_ids == hf_tokens[0]


class StepSpy:
    """The model runner, noting the requests of every step it prepares."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.steps = runner, []

    def prepare(self, out: Any) -> Any:
        self.steps.append({s.request_id for s in out.seqs})
        return self.runner.prepare(out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def test_a_request_submitted_alone_never_shares_a_step(path: Path,
                                                       hf_tokens: list[list[int]]) -> None:
    """`alone=True` (a row the poison-row record suspects): its steps hold no other request,
    the others wait for it or it for them, and every request keeps HF's greedy tokens."""
    from batchgen_data.config import make_engine_config
    from batchgen_data.engine.setup import build_parts

    config = make_engine_config(str(path), **ENGINE)
    parts = build_parts(config)
    spy = parts.runner = StepSpy(parts.runner)
    engine = Engine(config, parts)
    prompts = [p for i, p in enumerate(PROMPTS) if i != BAD]
    ids = [engine.submit(p, GREEDY, alone=i in (1, 3)) for i, p in enumerate(prompts)]
    outs: dict[str, Any] = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    want = [t for i, t in enumerate(hf_tokens) if i != BAD]
    assert [outs[r].outputs[0].token_ids for r in ids] == want
    alone = {ids[1], ids[3]}
    for step in spy.steps:
        assert not (step & alone) or len(step) == 1, step
    assert any(len(s) > 1 for s in spy.steps)  # the others still batch together
    # an export carries it: the importing engine runs it alone too
    rid = engine.submit(prompts[0], GREEDY, alone=True)
    state = engine.export(rid)
    assert state["alone"] is True
    assert engine.import_(state) == rid and all(s.alone for s in engine.live.requests[rid].seqs)


def test_an_engine_dead_error_inside_a_step_is_not_searched(path: Path) -> None:
    """A runner that says the engine is dead (a tensor-parallel rank gone) is believed: the
    step's failure goes up as it is, no part of the step is run again."""
    from batchgen_data.engine.driver import EngineDeadError

    engine = poisoned_engine(str(path), "run", **ENGINE)
    runner, calls = engine.runner, []

    def run(inp: Any) -> Any:
        calls.append(1)
        raise EngineDeadError("rank 1 died")

    runner.run = run  # type: ignore[method-assign]
    with pytest.raises(EngineDeadError, match="rank 1 died"):
        run_all(engine, GREEDY)
    assert len(calls) == 1

    # a step that fails, then a rank that dies during the search: the search stops there
    engine = poisoned_engine(str(path), "run", **ENGINE)
    calls.clear()

    def run_then_die(inp: Any) -> Any:
        calls.append(1)
        raise RuntimeError("boom") if len(calls) == 1 else EngineDeadError("rank 1 died")

    engine.runner.run = run_then_die  # type: ignore[method-assign]
    with pytest.raises(EngineDeadError, match="rank 1 died"):
        run_all(engine, GREEDY)
    assert len(calls) == 2


def test_a_program_whose_step_the_engine_fails_is_that_rows_error(
        path: Path, hf_tokens: list[list[int]]) -> None:
    # LLM.run: a program row whose step is poisoned ends as a row error (its other requests of
    # that step aborted); every other program keeps its HF tokens and the run finishes
    from batchgen_data import Generate, program

    @program
    def two_samples(row: dict) -> Any:
        a, b = yield [Generate(prompt_token_ids=row["ids"], temperature=0, max_tokens=8,
                               ignore_eos=True)] * 2
        return {"tokens": a.token_ids, "same": a.token_ids == b.token_ids}

    llm = LLM._over(poisoned_engine(str(path), "run", **ENGINE))
    outs = llm.run([{"ids": p} for p in PROMPTS], two_samples)
    assert "poisoned row" in outs[BAD]["error"] and "step 1:" in outs[BAD]["error"]
    for i, out in enumerate(outs):
        if i != BAD:
            assert out == {"tokens": hf_tokens[i], "same": True}
    assert not llm.engine.has_unfinished()
