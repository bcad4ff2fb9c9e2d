"""ProgramRun without a model: the guards, fan-out, replay and the public names' validation.

Results are made up here (the engine is not needed to drive a generator); the integration
tests (tests/integration/test_programs*.py) check real generations against LLM.chat.
"""
from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

import batchgen_data
from batchgen_data import Generate, GenerateResult, SamplingParams, program
from batchgen_data.programs import ProgramRun


def reply(text: str, messages: list[dict[str, Any]] | None = None) -> GenerateResult:
    turns = list(messages or [{"role": "user", "content": "q"}])
    return GenerateResult(text=text, token_ids=[ord(c) for c in text], finish_reason="stop",
                          prompt_token_ids=[1, 2, 3],
                          conversation=turns + [{"role": "assistant", "content": text}])


@program
def two_step(row: dict[str, Any]) -> Any:
    first = yield Generate(messages=[{"role": "user", "content": row["q"]}], max_tokens=4)
    more = yield [Generate(messages=first.conversation + [{"role": "user", "content": c}])
                  for c in ("x", "y")]
    return {"first": first.text, "more": [m.text for m in more]}


def test_public_names_are_exported() -> None:
    assert batchgen_data.program is program and batchgen_data.Generate is Generate
    assert {"program", "Generate", "GenerateResult"} <= set(batchgen_data.__all__)


def test_a_run_walks_single_and_fanout_steps() -> None:
    run = ProgramRun(two_step, {"q": "hello"})
    run.start()
    assert [g.messages for g in run.pending] == [[{"role": "user", "content": "hello"}]]
    assert run.pending[0].max_tokens == 4 and run.pending[0].temperature == 1.0
    run.feed([reply("one")])
    assert len(run.pending) == 2 and run.pending[1].messages[-1]["content"] == "y"
    assert run.pending[0].messages[1] == {"role": "assistant", "content": "one"}
    run.feed([reply("a"), reply("b")])
    assert run.done and run.error is None
    assert run.output == {"first": "one", "more": ["a", "b"]} and run.num_steps == 2


def test_replay_after_export_reaches_the_same_point() -> None:
    run = ProgramRun(two_step, {"q": "hello"})
    run.start()
    run.feed([reply("one")])
    state = run.export()
    again = ProgramRun.replay(two_step, state)
    assert again.num_steps == run.num_steps == 2 and not again.done
    assert [g.messages for g in again.pending] == [g.messages for g in run.pending]
    for r in (run, again):
        r.feed([reply("a"), reply("b")])
    assert again.output == run.output
    other = program(two_step.fn)
    other.name = "other"
    with pytest.raises(ValueError, match="not 'other'"):
        ProgramRun.replay(other, state)


def test_replay_of_a_program_that_changed_says_so() -> None:
    run = ProgramRun(two_step, {"q": "hello"})
    run.start()
    run.feed([reply("one")])
    state = run.export()

    @program
    def two_step_v2(row: dict[str, Any]) -> Any:  # now fans out at once
        yield [Generate("a"), Generate("b")]
        return {}

    two_step_v2.name = "two_step"
    again = ProgramRun.replay(two_step_v2, state)
    assert again.error is not None and "diverged on replay at step 1" in again.error


@pytest.mark.parametrize("body, message", [
    ("raise_", "program 'bad' raised KeyError at step 1: 'missing'"),
    ("yield_int", "program 'bad' yielded int at step 1"),
    ("yield_empty", "yielded an empty list at step 1"),
    ("yield_mixed", "yielded str at step 1"),
    ("return_list", "program 'bad' returned list; it must return a dict"),
    ("not_generator", "is not a generator function"),
    ("loop", "program 'bad' exceeded max_steps=3"),
])
def test_guards_give_an_error_naming_the_cause(body: str, message: str) -> None:
    def bad(row: dict[str, Any]) -> Any:
        if body == "not_generator":
            return {"a": 1}
        return _bodies(body)

    run = ProgramRun(program(bad, max_steps=3), {})
    run.start()
    while not run.done:
        run.feed([reply("r") for _ in run.pending])
    assert run.output is None and run.error is not None and message in run.error, run.error


def _bodies(body: str) -> Any:
    if body == "raise_":
        yield Generate("q")
        return {}["missing"]
    if body == "yield_int":
        yield 3
    if body == "yield_empty":
        yield []
    if body == "yield_mixed":
        yield [Generate("q"), "q"]
    if body == "return_list":
        yield Generate("q")
        return [1]
    while body == "loop":
        yield Generate("again")
    return {}


def test_a_failing_program_runs_its_finally_block() -> None:
    closed = []

    @program
    def cleanup(row: dict[str, Any]) -> Any:
        try:
            yield Generate("q")
            yield 42
        finally:
            closed.append(True)

    run = ProgramRun(cleanup, {})
    run.start()
    run.feed([reply("r")])
    assert "yielded int at step 2" in run.error and closed == [True]


def test_generate_validates_at_construction() -> None:
    with pytest.raises(ValueError, match="exactly one of prompt"):
        Generate()
    with pytest.raises(ValueError, match="exactly one of prompt"):
        Generate("a", messages=[{"role": "user", "content": "b"}])
    with pytest.raises(TypeError, match="temprature"):
        Generate("a", temprature=0.5)
    with pytest.raises(ValueError, match="list of Generates"):
        Generate("a", n=3)
    with pytest.raises(ValueError, match="max_tokens"):
        Generate("a", max_tokens=0)
    g = Generate("a", max_tokens=7, seed=3)
    assert g.params(SamplingParams(max_tokens=99, temperature=0.0)) == SamplingParams(
        max_tokens=7, seed=3, temperature=0.0)
    assert "max_tokens=7" in repr(g)


def test_program_decorator_options_and_schema() -> None:
    @program(max_steps=2, schema={"a": "string", "b": "list<int64>", "c": pa.float32()})
    def p(row: dict[str, Any]) -> Any:
        yield Generate("x")

    assert p.max_steps == 2 and p.name == "p"
    assert p.schema == pa.schema([("a", pa.string()), ("b", pa.list_(pa.int64())),
                                  ("c", pa.float32())])
    with pytest.raises(ValueError, match="max_steps"):
        program(max_steps=0)(p.fn)
    with pytest.raises(ValueError, match=r"schema\['a'\]"):
        program(schema={"a": "varchar"})(p.fn)
    with pytest.raises(TypeError, match="not a generator|@program|decorate"):
        ProgramRun(p.fn, {})  # type: ignore[arg-type]
