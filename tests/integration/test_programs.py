"""Per-row programs offline (`LLM.run`) on a tiny random Llama: each example equals its steps
run by hand with `LLM.chat`; broken programs are row errors; a program exported mid-flight and
replayed on another engine finishes with the same output; the next step reuses pinned KV."""
from __future__ import annotations

import json
import time
from typing import Any

import pytest

from batchgen_data import LLM, Generate, SamplingParams, program
from batchgen_data.programs import ProgramError
from batchgen_data.programs.offline import ProgramRunner

from engine_seams import watch_steps
from program_refs import EXAMPLES, example, revise_by_hand, rows_for

pytestmark = pytest.mark.timeout(300)

ENGINE = {"max_model_len": 256, "max_num_seqs": 16, "block_size": 4}
MAX_TOKENS = 6


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_equal_their_steps_by_hand(llm: LLM, name: str) -> None:
    prog_name, by_hand = EXAMPLES[name]
    prog = getattr(example(name), prog_name)
    rows = rows_for(name)
    outs = llm.run(rows, prog, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
    assert outs == by_hand(llm, rows, MAX_TOKENS)
    assert len(llm.engine.pins) == 0 and llm.engine.pins.num_blocks == 0  # all released


@program
def echo_cached(row: dict[str, Any]) -> Any:
    first = yield Generate(messages=[{"role": "user", "content": row["q"]}], temperature=0)
    second = yield Generate(messages=first.conversation + [{"role": "user", "content": "More."}],
                            temperature=0)
    return {"cached": second.num_cached_tokens, "full": len(first.prompt_token_ids) // 4 * 4,
            "text": second.text}


def test_the_next_step_reuses_the_pinned_conversation(model: str) -> None:
    # a pool far smaller than the traffic: 8 rows' first steps go through 2 seats, and without
    # pins later prompts recycle the finished conversations' blocks before the second steps run
    rows = [{"q": f"The quick brown fox {i} jumps over the lazy dog."} for i in range(8)]
    runs = {}
    for pins in (True, False):
        llm = LLM(model, max_model_len=128, max_num_seqs=2, block_size=4, num_kv_blocks=40)
        if not pins:
            llm.engine.pins.max_blocks = 0  # every pin refused
        runs[pins] = llm.run(rows, echo_cached, SamplingParams(max_tokens=MAX_TOKENS),
                             use_tqdm=False)
        assert llm.engine.pins.num_blocks == 0 and not llm.engine.has_unfinished()
    assert [o["text"] for o in runs[True]] == [o["text"] for o in runs[False]]
    pinned = [o for o in runs[True] if o["cached"] >= o["full"]]
    unpinned = [o for o in runs[False] if o["cached"] >= o["full"]]
    # every program's next step reuses its conversation; without pins it is only luck, which
    # the programs' depth-first order makes likely here (test_programs_kv.py squeezes harder)
    assert len(pinned) == len(rows) and len(unpinned) <= len(pinned), (runs[True], runs[False])


@program(max_steps=2)
def troubled(row: dict[str, Any]) -> Any:
    r = yield Generate(prompt=row["q"], temperature=0)
    kind = row["kind"]
    if kind == "raise":
        raise RuntimeError("model said " + repr(r.text[:0]))
    if kind == "bad_yield":
        yield {"prompt": "not a Generate"}
    if kind == "loop":
        while True:
            yield Generate(prompt=row["q"], temperature=0)
    if kind == "too_long":
        yield Generate(prompt="word " * 400)
    return {"text": r.text}


def test_broken_programs_are_row_errors_and_the_others_finish(llm: LLM) -> None:
    kinds = ["ok", "raise", "bad_yield", "loop", "too_long", "ok"]
    rows = [{"q": f"Summarise paragraph {i}", "kind": k} for i, k in enumerate(kinds)]
    outs = llm.run(rows, troubled, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
    by_hand = llm.generate([r["q"] for r in rows], SamplingParams(temperature=0,
                           max_tokens=MAX_TOKENS), use_tqdm=False)
    assert outs[0] == {"text": by_hand[0].outputs[0].text}
    assert outs[5] == {"text": by_hand[5].outputs[0].text}
    assert "raised RuntimeError at step 1: model said ''" in outs[1]["error"]
    assert "yielded dict at step 2" in outs[2]["error"]
    assert "exceeded max_steps=2" in outs[3]["error"]
    assert "step 2: prompt has" in outs[4]["error"] and "max_model_len" in outs[4]["error"]
    assert not llm.engine.has_unfinished() and len(llm.engine.pins) == 0
    with pytest.raises(ProgramError, match="raised RuntimeError"):
        llm.run(rows[:2], troubled, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False,
                on_error="raise")
    assert not llm.engine.has_unfinished() and len(llm.engine.pins) == 0


def test_export_mid_flight_and_replay_on_another_engine(model: str, llm: LLM) -> None:
    prog = example("programs_revise").revise
    rows = rows_for("programs_revise")
    params = SamplingParams(max_tokens=MAX_TOKENS)
    here = ProgramRunner(LLM(model, **ENGINE).engine, prog, params)
    there = ProgramRunner(LLM(model, **ENGINE).engine, prog, params)
    pids = [here.add(r) for r in rows]
    moved: dict[str, dict[str, Any]] = {}
    outputs: dict[int, dict[str, Any]] = {}
    while here.has_unfinished() or there.has_unfinished():
        for pid, out in here.step():
            outputs[pids.index(pid)] = out
        for pid, out in there.step():
            outputs[pids.index(moved[pid]["from"])] = out
        # move every program that has received at least one step's results
        for pid in [p for p, run in here.runs.items() if run.history]:
            state = here.export(pid)
            assert state["row"] in rows and state["history"]
            moved[there.import_(state)] = {"from": pid}
    assert moved and len(outputs) == len(rows)
    assert [outputs[i] for i in range(len(rows))] == revise_by_hand(llm, rows, MAX_TOKENS)
    assert not here.engine.has_unfinished() and len(here.engine.pins) == 0


def test_run_rejects_what_is_not_a_program(llm: LLM) -> None:
    with pytest.raises(TypeError, match="@batchgen_data.program"):
        llm.run([{"q": "x"}], echo_cached.fn)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"rows\[0\] must be a dict"):
        llm.run(["x"], echo_cached)  # type: ignore[list-item]


@program(max_steps=8)
def loops(row: dict[str, Any]) -> Any:
    text = ""
    for _ in range(row["steps"]):
        r = yield Generate(prompt=f"{row['q']} {text}", temperature=0, max_tokens=2)
        text = r.text
    return {"q": row["q"]}


def test_a_long_program_never_holds_up_the_others(llm: LLM,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"q": "Summarise paragraph 0", "steps": 6}] + [
        {"q": f"The quick brown fox {i}", "steps": 1} for i in range(5)]
    runner = ProgramRunner(llm.engine, loops)
    pids = [runner.add(r) for r in rows]
    shapes = watch_steps(llm.engine, monkeypatch)
    order = []
    while runner.has_unfinished():
        order += [pid for pid, _ in runner.step()]
    assert order[-1] == pids[0] and sorted(order) == sorted(pids)
    assert max(s.num_seqs for s in shapes) == len(rows)  # every first step in one batch


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_scripts_run(model: str, name: str, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.argv", [name, "--model", model, "--max-tokens", "2"])
    example(name).main()
    # the summary's own line, wherever it lands: the suite's Ray driver may print a cluster
    # message ("(raylet) ...") into this capture, before it or after
    summary = json.loads([ln for ln in capsys.readouterr().out.splitlines()
                          if ln.startswith('{"rows"')][-1])
    assert summary["errors"] == 0 and summary["rows"] >= 4


def test_connector_rows_run_programs_through_the_driver(model: str, llm: LLM) -> None:
    """The path Ray and Spark share (ProgramRows → DrivenPrograms → EngineDriver), no cluster."""
    from batchgen_data.connectors.common import RequestBuilder
    from batchgen_data.connectors.programs import ProgramRows
    from batchgen_data.engine.driver import EngineDriver
    from batchgen_data.engine.engine import Engine

    name = "programs_judge"
    prog = example(name).judge_both_orders
    rows = rows_for(name)
    driver = EngineDriver(Engine.from_kwargs(model, **ENGINE))
    try:
        lifecycle = ProgramRows(driver, RequestBuilder.from_engine(
            driver.engine, {"max_tokens": MAX_TOKENS}), 0, prog)
        futures = [lifecycle.submit(r) for r in rows + [{"question": "q"}]]
        got = [lifecycle.outcome(f) for f in futures]
        want = EXAMPLES[name][1](llm, rows, MAX_TOKENS)
        assert got[:-1] == [{**w, "error": None} for w in want]
        assert "raised KeyError at step 0: 'answer_a'" in got[-1]["error"]
        # a row nobody reads any more: its steps are aborted and its pins released
        unread = [lifecycle.submit(r) for r in rows]
        lifecycle.abandon(unread)
        for _ in range(50):  # steps submitted meanwhile finish or are aborted, then let go
            if driver.call(lambda e: (len(e.pins), e.num_unfinished())).result(60) == (0, 0):
                break
            time.sleep(0.2)
        assert driver.call(lambda e: (len(e.pins), e.num_unfinished())).result(60) == (0, 0)
    finally:
        driver.shutdown()
