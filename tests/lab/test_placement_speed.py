"""The placement policy's speed rules (`max_receiver_slowdown`, `shed_slow_factor`): the long tail
stays off stragglers and leaves them, judged only from each engine's measured decode-step floor."""
from __future__ import annotations

from dataclasses import replace

import pytest

from batchgen_data.engine.stats import EngineStats
from batchgen_data.placement import (EngineLoad, Move, PlacementConfig, RequestSummary,
                                     pick_donors, plan_moves)

SEATS = 64
FAST, SLOW = 0.010, 0.015  # seconds of each engine's fastest decode step (a 1.5x straggler)


def load(eid: str, running: int = 0, used_blocks: int = 0, step_s: float = FAST) -> EngineLoad:
    return EngineLoad(eid, 0, running, 0, 0, 1000 - used_blocks, 1000, SEATS, 16,
                      decode_step_s=step_s)


def running(rid: str, tokens: int, age: int) -> RequestSummary:
    return RequestSummary(rid, "running", tokens, age, tokens - 1)


def routes(moves: list[Move]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for mv in moves:
        out.setdefault(f"{mv.src}->{mv.dst}", []).extend(mv.request_ids)
    return out


def test_max_receiver_slowdown_keeps_the_oldest_row_off_a_straggler() -> None:
    # a busy fast donor; the receiver with the least KV is a straggler, the other is fast
    donor = load("d", running=20, used_blocks=400)
    slow, fast = load("s", step_s=SLOW), load("f", running=2, used_blocks=20)
    reqs = {"d": [running("old", 2000, 900), running("mid", 1500, 600)]}
    plain = routes(plan_moves([donor, slow, fast], reqs, PlacementConfig()))
    assert plain["d->s"][0] == "old"  # the default sends the oldest to the emptiest
    rule = PlacementConfig(max_receiver_slowdown=1.2)
    got = routes(plan_moves([donor, slow, fast], reqs, rule))
    assert "d->s" not in got and got["d->f"][0] == "old"
    # with only the straggler short of work nothing running moves
    assert plan_moves([donor, slow], reqs, rule) == []
    # an engine not measured yet (floor 0) is not judged, and timing noise between equal
    # devices (10% here) blocks nothing
    for other in (replace(slow, decode_step_s=0.0), replace(slow, decode_step_s=1.1 * FAST)):
        assert routes(plan_moves([donor, other], reqs, rule))["d->s"][0] == "old"


def test_shed_moves_a_lone_long_row_off_a_straggler() -> None:
    # one long row on a slow engine, a fast engine idle: moving it lowers no KV load (the
    # default keeps it) but every token after the move is 1.5x faster
    slow = load("s", running=1, used_blocks=100, step_s=SLOW)
    idle = load("f")
    reqs = {"s": [running("long", 1600, 1500)]}
    assert plan_moves([slow, idle], reqs, PlacementConfig()) == []
    assert pick_donors([slow, idle], PlacementConfig()) == []
    cfg = PlacementConfig(shed_slow_factor=1.3)
    assert [d.engine_id for d in pick_donors([slow, idle], cfg)] == ["s"]
    assert routes(plan_moves([slow, idle], reqs, cfg)) == {"s->f": ["long"]}
    # a gap below the factor is noise, not a straggler; an unmeasured floor is not judged
    near = load("s", running=1, used_blocks=100, step_s=1.2 * FAST)
    assert plan_moves([near, idle], {"s": reqs["s"]}, cfg) == []
    assert plan_moves([slow, replace(idle, decode_step_s=0.0)], reqs, cfg) == []


def test_shed_rows_never_go_back_and_fill_receivers_only_to_short_of_work() -> None:
    cfg = PlacementConfig(shed_slow_factor=1.3)
    # after shedding, the fast engine holds much more KV than the idle straggler: the KV rule
    # alone would send its oldest back, the speed rule does not
    fast = load("f", running=10, used_blocks=600)
    idle_slow = load("s", step_s=SLOW)
    back = {"f": [running("r1", 3000, 900), running("r2", 2000, 800)]}
    assert routes(plan_moves([fast, idle_slow], back, PlacementConfig()))["f->s"]
    assert plan_moves([fast, idle_slow], back, cfg) == []
    # a straggler with 40 rows sheds to an idle fast engine until it has half its seats busy
    slow = load("s", running=40, used_blocks=300, step_s=SLOW)
    reqs = {"s": [running(f"q{i}", 100, 400 - i) for i in range(40)]}
    got = routes(plan_moves([slow, load("f")], reqs, cfg))["s->f"]
    assert got == [f"q{i}" for i in range(SEATS // 2)]  # oldest first


def test_speed_rule_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="shed_slow_factor"):
        PlacementConfig(shed_slow_factor=1.0)
    with pytest.raises(ValueError, match="max_receiver_slowdown"):
        PlacementConfig(max_receiver_slowdown=0.9)
    assert PlacementConfig().shed_slow_factor == PlacementConfig().max_receiver_slowdown == 0.0


def test_engine_reports_its_fastest_pure_decode_step() -> None:
    stats = EngineStats()
    stats.record(num_seqs=4, num_tokens=400, num_sampled=4, dt=0.5)  # a prefill step
    assert stats.min_decode_step_s == 0.0
    for dt in (0.03, 0.02, 0.04):
        stats.record(num_seqs=8, num_tokens=8, num_sampled=8, dt=dt)
    stats.record(num_seqs=8, num_tokens=20, num_sampled=8, dt=0.01)  # a mixed step
    assert stats.min_decode_step_s == 0.02
    # as the engine records them: only steps with at most half the seats busy count, a full
    # engine's steps being slow for its load, not its device
    light = EngineStats()
    light.record(num_seqs=8, num_tokens=8, num_sampled=8, dt=0.02, light_seqs=4)
    assert light.min_decode_step_s == 0.0
    light.record(num_seqs=4, num_tokens=4, num_sampled=4, dt=0.03, light_seqs=4)
    assert light.min_decode_step_s == 0.03


def test_a_straggling_engine_reports_a_higher_floor() -> None:
    # the emulated runner sleeps the cost model's step time x slowdown and reports that as the
    # step's device time (`device_step_s`), as a GPU would: the straggler's 3x shows in its load
    # report exactly, whatever the box's late wake-ups do to the wall clock
    from batchgen_lab import emulated_runner as emu
    from batchgen_data.sampling_params import SamplingParams

    floors = []
    for slowdown in (1.0, 3.0):
        spec = emu.EmulatedSpec("h200-llama8b", scale=1e-3, slowdown=slowdown,
                                tokens_per_step=16)
        e = emu.build_engine(spec.model_string(), max_num_seqs=4)
        assert e.load().decode_step_s == 0.0  # nothing measured yet
        for i in range(2):
            e.submit(emu.encode_prompt(5, 16, salt=i),
                     SamplingParams(temperature=0.0, max_tokens=10), request_id=f"r{i}")
        while e.has_unfinished():
            e.step()
        floors.append(e.load().decode_step_s)
    cost = spec.cost_model()
    # the fastest: the first decode step, 2 sequences over 2 x (16 prompt + 1 new) tokens of KV
    assert floors[0] == pytest.approx(cost.step_time(2, 2 * 17, 2) * 1e-3, rel=1e-9)
    assert floors[1] == pytest.approx(3.0 * floors[0], rel=1e-9)


def test_the_ray_connector_offers_the_rules_opt_in() -> None:
    # off in what the coordinator plans with by default (wall-clock floors of engines sharing
    # CPU cores differ by contention alone); `SPEED_RULES` turns them on, as
    # lab/batchgen_lab/ray_emulated.py does for both the connector and the simulator
    from batchgen_data.connectors.migration_options import DEFAULT_PLACEMENT, SPEED_RULES

    off = PlacementConfig(**DEFAULT_PLACEMENT)
    assert off.seat_receivers and off.max_receiver_slowdown == 0 and off.shed_slow_factor == 0
    cfg = PlacementConfig(**{**DEFAULT_PLACEMENT, **SPEED_RULES})
    assert cfg.max_receiver_slowdown > 1.0 and cfg.shed_slow_factor > cfg.max_receiver_slowdown


def test_decode_speed_fit_reads_the_device_not_the_load() -> None:
    # a fast engine whose lightest steps carried long contexts and a 1.5x straggler whose
    # lightest steps were short: their floors (fastest light step) differ by less than 1.3x,
    # the fitted reference step by exactly 1.5x
    from batchgen_data.engine.stats import DecodeSpeed
    from batchgen_lab.sim.costmodel import CostModel

    cost = CostModel("linear", c0=0.1, c_tok=2e-3, c_kv=1.4e-4, c_seq=3e-4,
                     bytes_per_token=1, kv_capacity_tokens=10**6, pcie_bytes_per_s=1.0,
                     link_bytes_per_s=1.0, c_mem=0.27)
    fast, slow = EngineStats(), EngineStats()
    for n in range(1, 17):  # contexts vary between steps of the same batch size
        kv = n * (900 + 37 * (n % 5))
        fast.record(n, n, n, cost.step_time(n, kv, n), light_seqs=16, kv_tokens=kv)
        kv = n * (100 + 11 * (n % 3))
        slow.record(n, n, n, 1.5 * cost.step_time(n, kv, n), light_seqs=16, kv_tokens=kv)
    assert slow.min_decode_step_s / fast.min_decode_step_s < 1.3
    assert slow.decode_step_s() / fast.decode_step_s() == pytest.approx(1.5, rel=1e-6)
    # the reference step: one sequence, no context
    assert fast.decode_step_s() == pytest.approx(cost.step_time(1, 0, 1), rel=1e-6)
    # steps of one shape cannot separate seqs from KV: the floor stands until they can
    same = EngineStats()
    for _ in range(20):
        same.record(4, 4, 4, 0.5, light_seqs=16, kv_tokens=400)
    assert same.decode_speed.step_s() == 0.0 and same.decode_step_s() == 0.5
    # too few steps to fit, and a prefill step never counts
    few = DecodeSpeed()
    for n in range(1, DecodeSpeed.MIN_STEPS):
        few.record(n, 10 * n + n * n, 0.1 + 0.01 * n)
    assert few.step_s() == 0.0
    stats = EngineStats()
    stats.record(4, 400, 4, 0.5, kv_tokens=400)
    assert len(stats.decode_speed.samples) == 0
    assert stats.as_dict()["decode_speed"] == {"step_s": 0.0, "steps": 0}


def test_an_emulated_straggler_reports_its_factor_from_uneven_rows() -> None:
    # rows of different lengths give steps of several shapes; the engine's load report then
    # carries the fitted reference step, exactly the cost model's x slowdown on both engines
    from batchgen_lab import emulated_runner as emu
    from batchgen_data.sampling_params import SamplingParams

    speeds = []
    for slowdown in (1.0, 1.5):
        spec = emu.EmulatedSpec("h200-llama8b", scale=1e-4, slowdown=slowdown,
                                tokens_per_step=16)
        e = emu.build_engine(spec.model_string(), max_num_seqs=8)
        for i in range(8):
            e.submit(emu.encode_prompt(4 + 3 * i, 2 + 3 * i, salt=i),
                     SamplingParams(temperature=0.0, max_tokens=64), request_id=f"r{i}")
        while e.has_unfinished():
            e.step()
        assert e.stats.decode_speed.step_s() > 0
        speeds.append(e.load().decode_step_s)
    cost = spec.cost_model()
    assert speeds[0] == pytest.approx(cost.step_time(1, 0, 1) * 1e-4, rel=1e-6)
    assert speeds[1] == pytest.approx(1.5 * speeds[0], rel=1e-6)
