"""The emulated runner: the real engine over a runner that sleeps the cost model's step time.

Rows must stop at the length written into their prompt (also after a move to another engine),
the modelled time must be exactly the cost model's sum over the steps the scheduler made, and a
straggler's time must scale with its slowdown.
"""
from __future__ import annotations

import time

import pytest

from batchgen_lab import emulated_runner as emu
from batchgen_data.engine.engine import Engine
from batchgen_data.sampling_params import SamplingParams
from batchgen_lab.sim.costmodel import get_preset
from engine_seams import watch_steps

GREEDY = SamplingParams(temperature=0.0, max_tokens=500)


def engine(slowdown: float = 1.0, g: int = 1, seats: int = 8) -> Engine:
    spec = emu.EmulatedSpec("h200-llama8b", scale=1e-3, slowdown=slowdown, tokens_per_step=g)
    return emu.build_engine(spec.model_string(), max_num_seqs=seats)


def run(e: Engine, lengths: list[int], prompt_len: int = 20) -> dict[str, list[int]]:
    for i, n in enumerate(lengths):
        e.submit(emu.encode_prompt(n, prompt_len, salt=i), GREEDY, request_id=f"r{i}")
    out = {}
    while e.has_unfinished():
        for o in e.step():
            assert o.outputs[0].finish_reason == "stop"
            out[o.request_id] = o.outputs[0].token_ids
    return out


def test_spec_round_trip_and_errors() -> None:
    spec = emu.EmulatedSpec("a100-qwen0.5b", scale=0.25, slowdown=1.5, tokens_per_step=8)
    assert emu.EmulatedSpec.parse(spec.model_string()) == spec
    assert emu.EmulatedSpec.parse("emulated:") == emu.EmulatedSpec()
    with pytest.raises(ValueError, match="unknown option"):
        emu.EmulatedSpec.parse("emulated:h200-llama8b?speed=2")
    with pytest.raises(ValueError, match="scale"):
        emu.EmulatedSpec.parse("emulated:h200-llama8b?scale=0")
    with pytest.raises(ValueError, match="unknown cost-model preset"):
        emu.EmulatedSpec("no-such-preset").cost_model()


def test_prompt_carries_the_output_length_and_a_unique_prefix() -> None:
    for n in (1, 255, 256, 4097, emu.MAX_OUTPUT):
        ids = emu.encode_prompt(n, 30, salt=7)
        assert len(ids) == 30 and emu.output_len_of(ids) == n and max(ids) < emu.VOCAB
    assert emu.encode_prompt(5, 16, 1) != emu.encode_prompt(5, 16, 2)
    assert len(emu.encode_prompt(5, 1)) == 2  # the header needs two tokens
    with pytest.raises(ValueError):
        emu.encode_prompt(0, 10)
    with pytest.raises(ValueError):
        emu.output_len_of([3, 4, 5])


def test_rows_stop_at_their_length_and_time_is_the_cost_models(
        monkeypatch: pytest.MonkeyPatch) -> None:
    e = engine()
    cost = get_preset("h200-llama8b")
    shapes = watch_steps(e, monkeypatch)
    lengths = [1, 3, 40, 17, 90, 2, 64, 5, 33, 8, 120]  # more rows than seats: some wait
    out = run(e, lengths)
    assert {r: len(t) for r, t in out.items()} == {f"r{i}": n for i, n in enumerate(lengths)}
    assert all(t[-1] == emu.EOS and emu.EOS not in t[:-1] for t in out.values())
    assert out["r2"][:3] == [2, 3, 4]  # deterministic filler
    # what the simulator would charge for these steps
    expected = sum(cost.step_time(s.num_new_tokens, s.kv_tokens, s.num_seqs)
                   for s in shapes if s.num_seqs)
    assert e.runner.modelled_s == pytest.approx(expected, rel=1e-9)
    assert e.runner.num_steps >= max(lengths)
    assert e.runner.slept_s >= 0.5 * e.runner.modelled_s * 1e-3
    assert 0.0 <= e.runner.overhead() < 1.0
    assert e.runner.first_step_at is not None and e.runner.first_step_at <= time.time()


def test_slowdown_and_coarse_time() -> None:
    base, slow = engine(), engine(slowdown=1.5)
    lengths = [12, 30, 7]
    assert run(base, lengths) == run(slow, lengths)
    assert slow.runner.modelled_s == pytest.approx(1.5 * base.runner.modelled_s, rel=1e-9)
    cost = get_preset("h200-llama8b")
    coarse = emu.coarsen(cost, 16)
    # a coarse decode step is 16 real decode steps over 16x the context
    assert coarse.step_time(8, 100, 8) == pytest.approx(16 * cost.step_time(8, 1600, 8))
    assert coarse.kv_capacity_tokens == cost.kv_capacity_tokens // 16
    assert emu.coarsen(cost, 1) is cost
    assert engine(g=16).runner.cost == coarse


def test_moved_row_still_stops_at_its_length() -> None:
    src, dst = engine(), engine()
    src.submit(emu.encode_prompt(50, 20), GREEDY, request_id="a")
    for _ in range(10):
        src.step()
    state = src.export("a", include_kv=True)
    assert len(state["seqs"][0]["output_token_ids"]) == 10  # prefill samples one
    dst.import_(state)
    done = []
    while dst.has_unfinished():
        done += dst.step()
    assert state["seqs"][0]["kv"][0][0].shape[0] > 0  # the KV went along (as bytes of time)
    assert len(done[0].outputs[0].token_ids) == 50 and done[0].outputs[0].finish_reason == "stop"
