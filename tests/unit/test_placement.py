"""Placement policy on hand-made load reports: triggers, what moves where, ship-or-recompute."""
from __future__ import annotations

import pytest

from batchgen_data.placement import (EngineLoad, Move, PlacementConfig, RequestSummary,
                                     TransferCost, find_receivers, is_short_of_work, pick_donors,
                                     plan_moves, rows_wanted)

SEATS = 64


def load(eid: str, waiting: int = 0, running: int = 0, held: int = 0, used_blocks: int = 0,
         total: int = 1000) -> EngineLoad:
    return EngineLoad(eid, waiting, running, held, 0, total - used_blocks, total, SEATS, 16)


def waiting_reqs(prefix: str, n: int) -> list[RequestSummary]:
    return [RequestSummary(f"{prefix}{i}", "waiting", 100, 0) for i in range(n)]


def running_req(rid: str, tokens: int, age: int) -> RequestSummary:
    return RequestSummary(rid, "running", tokens, age, tokens - 1)


def moved(moves: list[Move], kind: str | None = None) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for mv in moves:
        if kind is None or mv.kind == kind:
            out.setdefault(f"{mv.src}->{mv.dst}", []).extend(mv.request_ids)
    return out


def test_load_report_counts_active_sequences_and_device_kv() -> None:
    ld = EngineLoad("e0", waiting=3, running=5, held=1, remaining_tokens_est=900, free_blocks=90,
                    total_blocks=100, max_num_seqs=8, block_size=16)
    assert (ld.waiting, ld.running, ld.held, ld.num_active) == (3, 5, 1, 9)
    assert ld.kv_tokens == 10 * 16
    assert (ld.kv_bytes_per_token, ld.prefill_tokens_per_s) == (0, 0)  # not measured


def test_late_binding_keeps_queues_shallow() -> None:
    cfg = PlacementConfig(queue_depth=32)
    assert rows_wanted(0, SEATS, cfg) == SEATS + 32
    assert rows_wanted(SEATS + 32, SEATS, cfg) == 0
    assert rows_wanted(SEATS + 100, SEATS, cfg) == 0


def test_trigger_needs_an_engine_short_of_work() -> None:
    cfg = PlacementConfig(starve_fraction=0.5)
    assert is_short_of_work(load("a", running=10), cfg)
    assert not is_short_of_work(load("a", running=10, waiting=1), cfg)
    assert not is_short_of_work(load("a", running=40), cfg)
    busy = [load("a", running=SEATS, waiting=50), load("b", running=SEATS)]
    assert find_receivers(busy, cfg) == [] and pick_donors(busy, cfg) == []
    assert plan_moves(busy, {"a": waiting_reqs("a", 50)}, cfg) == []
    order = find_receivers([load("x", running=20), load("y", running=2), load("z", running=9)], cfg)
    assert [r.engine_id for r in order] == ["y", "z", "x"]


def test_surplus_waiting_moves_from_the_back_of_the_queue() -> None:
    cfg = PlacementConfig(max_requests_per_receiver=16)
    loads = [load("busy", running=SEATS, waiting=20, used_blocks=500), load("idle", running=1)]
    assert [d.engine_id for d in pick_donors(loads, cfg)] == ["busy"]
    moves = plan_moves(loads, {"busy": waiting_reqs("w", 20)}, cfg)
    got = moved(moves, "waiting")["busy->idle"]
    assert got == [f"w{i}" for i in range(19, 3, -1)]  # 16 from the back; the head stays
    assert all(not mv.ship_kv for mv in moves)


def test_waiting_that_will_be_seated_next_step_stays() -> None:
    cfg = PlacementConfig()
    loads = [load("a", running=10, waiting=5, used_blocks=300), load("b")]
    assert moved(plan_moves(loads, {"a": waiting_reqs("w", 5)}, cfg), "waiting") == {}
    # ... unless the donor's KV memory is full: then nothing it queues can start
    tight = [load("a", running=10, waiting=5, used_blocks=995), load("b")]
    assert len(moved(plan_moves(tight, {"a": waiting_reqs("w", 5)}, cfg), "waiting")["a->b"]) == 5


def test_held_sequences_move_before_running_ones() -> None:
    cfg = PlacementConfig(max_requests_per_receiver=2)
    reqs = [RequestSummary("h0", "held", 3000, 900, 0), running_req("r0", 9000, 8000)]
    loads = [load("a", running=30, held=1, used_blocks=900), load("b")]
    moves = plan_moves(loads, {"a": reqs}, cfg)
    assert moved(moves, "held") == {"a->b": ["h0"]}


def test_long_tail_spreads_oldest_first_without_piling_up() -> None:
    cfg = PlacementConfig(min_running_age=256)
    reqs = [running_req(f"old{i}", 10_000, 9_000 - i) for i in range(4)]
    reqs += [running_req("young", 10_000, 100)]  # too young to be the tail
    loads = [load("a", running=5, used_blocks=50_000 // 16, total=10_000), load("b"), load("c")]
    moves = plan_moves(loads, {"a": reqs}, cfg)
    # KV evens out 2/2/1, handed out in turn, oldest first: no pile on one engine
    assert moved(moves, "running") == {"a->b": ["old0", "old2"], "a->c": ["old1"]}


def test_no_move_back_after_applying_moves() -> None:
    cfg = PlacementConfig()
    a_reqs = [running_req(f"r{i}", 8000, 7000) for i in range(3)]
    loads = [load("a", running=3, used_blocks=1500), load("b")]
    first = plan_moves(loads, {"a": a_reqs}, cfg)
    assert moved(first, "running") == {"a->b": ["r0"]}
    after = [load("a", running=2, used_blocks=1000), load("b", running=1, used_blocks=500)]
    summaries = {"a": a_reqs[1:], "b": a_reqs[:1]}
    assert moved(plan_moves(after, summaries, cfg), "running") == {}


def test_small_gain_is_not_worth_a_move() -> None:
    # a lone sequence gains nothing from an empty engine; a short one not enough
    assert plan_moves([load("a", running=1, used_blocks=500), load("b")],
                      {"a": [running_req("r", 8000, 7000)]}, PlacementConfig()) == []
    cfg = PlacementConfig(min_kv_gain_tokens=4096)
    loads = [load("a", running=1, used_blocks=200), load("b")]
    assert plan_moves(loads, {"a": [running_req("r", 3000, 2000)]}, cfg) == []


def test_ship_or_recompute_follows_the_cost_model() -> None:
    # 8B model: 128 KiB/token, prefill ~34k tok/s on an H200
    fast = TransferCost(131072, link_bytes_per_s=25e9, pcie_bytes_per_s=50e9,
                        prefill_tokens_per_s=34_000)
    slow = TransferCost(131072, link_bytes_per_s=1.25e9, pcie_bytes_per_s=50e9,
                        prefill_tokens_per_s=34_000)
    assert fast.should_ship(8000) and not fast.should_ship(10)  # latency dominates tiny ones
    assert not slow.should_ship(8000)
    assert fast.ship_seconds(8000) < fast.recompute_seconds(8000)
    reqs = [running_req("r", 8000, 7000), running_req("s", 8000, 6000)]
    loads = [load("a", running=2, used_blocks=1000), load("b")]
    [mv] = plan_moves(loads, {"a": reqs}, PlacementConfig(transfer=fast))
    assert mv.kind == "running" and mv.ship_kv
    [mv] = plan_moves(loads, {"a": reqs}, PlacementConfig(transfer=slow))
    assert not mv.ship_kv
    [mv] = plan_moves(loads, {"a": reqs}, PlacementConfig())  # no cost model: recompute
    assert not mv.ship_kv


def test_bad_inputs_name_the_field() -> None:
    with pytest.raises(ValueError, match="starve_fraction"):
        PlacementConfig(starve_fraction=0.0)
    with pytest.raises(ValueError, match="kind"):
        RequestSummary("r", "sleeping", 1, 0)
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        TransferCost(1, 0.0, 1.0, 1.0)


def test_seat_receivers_take_queued_rows_but_not_running_ones() -> None:
    # "b" is busy (not short of work) but has a free seat and no queue
    loads = [load("a", running=SEATS, waiting=6, used_blocks=500),
             load("b", running=SEATS - 2, used_blocks=400)]
    reqs = waiting_reqs("w", 6) + [running_req("old", 8000, 7000)]
    assert plan_moves(loads, {"a": reqs}, PlacementConfig()) == []  # default: starving only
    cfg = PlacementConfig(seat_receivers=True)
    assert [r.engine_id for r in find_receivers(loads, cfg)] == ["b"]
    moves = plan_moves(loads, {"a": reqs}, cfg)
    assert moved(moves, "waiting") == {"a->b": ["w5", "w4"]}  # its two free seats
    assert moved(moves, "running") == {}
    # no seat, or KV memory tight: not a receiver
    full = load("b", running=SEATS)
    tight = load("b", running=SEATS - 2, used_blocks=999)
    assert find_receivers([loads[0], full], cfg) == find_receivers([loads[0], tight], cfg) == []


def test_the_coordinator_process_does_not_import_torch() -> None:
    # the migration coordinator is its own Ray actor process: it needs the placement policy,
    # not the engine, and importing torch there cost ~2.4 s of CPU at every job's start
    import subprocess
    import sys

    code = ("import sys, batchgen_data.placement, batchgen_data.connectors.ray.coordinator\n"
            "heavy = {'torch', 'transformers', 'ray.data'} & set(sys.modules)\n"
            "assert not heavy, heavy\n"
            "from batchgen_data import LLM, SamplingParams\n"  # still there on first use
            "assert 'torch' in sys.modules and LLM.__name__ == 'LLM'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
