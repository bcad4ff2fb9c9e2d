"""The expert-parallel remedies added as "+feature" arms: pin, tiers, early re-partition."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from batchgen_lab.sim.ep_preset import EP_PRESETS
from batchgen_lab.sim.lockstep import EPMode
from batchgen_lab.sim.lockstep_run import EPCluster
from batchgen_lab.sim.lockstep_tiers import repartition_early
from batchgen_lab.sim.scenario import SimConfig, straggler_factors
from batchgen_lab.sim.workload import Workload

DSV3 = EP_PRESETS["ep-moe-dsv3"]
SMALL = replace(DSV3, seats_per_rank=8, prefill_budget=2048)


def tail_rows(rows: int, seed: int, cap: int = 2500) -> Workload:
    rng = np.random.default_rng(seed)
    out = np.minimum(np.rint(rng.lognormal(5.5, 1.0, rows)), cap).astype(np.int64) + 1
    return Workload("tail", rng.integers(32, 513, rows), out, cap + 1)


def test_features_are_named_once_on_migrate_modes_only() -> None:
    m = EPMode("migrate-repartition+pin+early")
    assert m.base == "migrate-repartition" and m.has("pin") and m.has("early")
    assert not m.has("tiers") and m.late
    for bad in ("static-tuned+pin", "migrate+pin+pin", "migrate+early", "migrate+fast"):
        with pytest.raises(ValueError):
            EPMode(bad)
    SimConfig(64, 10, preset="ep-moe-dsv3", modes=("migrate+tiers",))
    with pytest.raises(ValueError, match="modes"):
        SimConfig(64, 10, preset="ep-moe-dsv3", modes=("continuous+pin",))


def _group_hops(c: EPCluster) -> list[float]:
    """Seconds between a row's consecutive moves between groups."""
    assert c.trace is not None
    return [t1 - t0 for moves in c.trace.group_moves.values()
            for t0, t1 in zip(moves, moves[1:])]


def test_pin_keeps_a_moved_sequence_in_place_and_cuts_the_hops() -> None:
    wl = tail_rows(900, seed=4)
    f = straggler_factors(64, 0.125, 1.5, seed=4)
    runs = {}
    for name in ("migrate", "migrate+pin"):
        c = EPCluster(wl, 64, SMALL, EPMode(name, tick_s=0.2, pin_s=3.0), f, trace=True)
        runs[name] = (c, c.run())
    free, pinned = _group_hops(runs["migrate"][0]), _group_hops(runs["migrate+pin"][0])
    assert min(free) < 3.0  # without the pin, rows do hop back within the pin time
    assert min(pinned) >= 3.0 - 1e-9 and len(pinned) < len(free)
    assert not np.isnan(runs["migrate+pin"][1].finish_time).any()


def test_tiers_turn_groups_light_as_rows_drain_and_light_groups_bind_nothing() -> None:
    wl = tail_rows(1500, seed=5)
    f = straggler_factors(128, 0.125, 1.5, seed=5)
    c = EPCluster(wl, 128, SMALL, EPMode("migrate+tiers", tick_s=0.2), f)
    res = c.run()
    assert not np.isnan(res.finish_time).any() and c.done == wl.num_rows
    assert 1 < len(c.light) <= len(c.groups) - 1
    assert c.light[0] == c.tail_group and res.moved.get("shed", 0) > 0
    # only bulk groups ever received rows from the dispatcher, except the tail group's first
    # window (it was light from the start, so none)
    assert c.tail_group not in set(c.home.tolist())


def test_early_repartition_widens_a_light_group_and_pays_for_the_kv_layout() -> None:
    wl = Workload("few", np.array([400, 300, 200]), np.array([5000, 5000, 5000]), 5001)
    c = EPCluster(wl, 16, DSV3, EPMode("migrate-repartition+early"))
    grp = c.groups[0]
    for i in range(3):  # three decoding sequences, 2000 tokens in
        assert grp.seat(i, int(wl.input_lens[i]) + 2000, 3000, 2000, i, False)
    repartition_early(c, grp, 10.0)
    assert grp.tp > 1 and c.reshards == 1
    kv_s = float(grp.loads()[2].max()) * DSV3.kv_bytes_per_token / DSV3.link_bytes_per_s
    assert grp.busy_until == pytest.approx(10.0 + DSV3.reshard_s + kv_s)
    before = grp.tp
    repartition_early(c, grp, grp.busy_until)  # already the best width: no second pause
    assert grp.tp == before and c.reshards == 1
    res = EPCluster(wl, 16, DSV3, EPMode("migrate-repartition+early")).run()
    assert res.reshards >= 1 and not np.isnan(res.finish_time).any()


@pytest.mark.parametrize("mode", ["migrate+pin", "migrate-repartition+tiers",
                                  "migrate-repartition+pin+tiers+early"])
def test_every_row_finishes_once_with_the_remedies(mode: str) -> None:
    wl = tail_rows(700, seed=1)
    f = straggler_factors(64, 0.125, 1.5, seed=1)
    c = EPCluster(wl, 64, SMALL, EPMode(mode, tick_s=0.2), f)
    res = c.run()
    assert not np.isnan(res.finish_time).any() and c.done == wl.num_rows
    assert all(n == 0 for n in c.in_flight) and all(n == 0 for n in c.batch_left)
    for g in c.groups:
        assert g.active() == 0 and not g.arrivals and not g.shared and not any(g.queues)


def test_align_admits_in_rounds_spread_over_the_ranks() -> None:
    # rows with long prompts at steady state: without +align the group seats a row whenever a
    # seat frees, so most steps carry one rank's prefill and every rank waits for it; with it
    # the group waits for a free seat per rank and every rank prefills at once
    rng = np.random.default_rng(7)
    rows = 1200
    wl = Workload("prompts", rng.integers(1500, 3000, rows),
                  rng.integers(50, 400, rows), 400)
    runs = {}
    for name in ("migrate", "migrate+align"):
        c = EPCluster(wl, 16, SMALL, EPMode(name, tick_s=0.2))
        runs[name] = (c, c.run())
    assert not np.isnan(runs["migrate+align"][1].finish_time).any()
    assert runs["migrate+align"][1].bct_s < 0.8 * runs["migrate"][1].bct_s

    # one round by hand: 16 free seats (one a rank) and 20 waiting rows: each rank gets one
    # row, the 4 left wait for seats
    c = EPCluster(Workload("w", np.arange(100, 120), np.full(20, 50), 50), 16, SMALL,
                  EPMode("migrate+align", align_seats=1))
    grp = c.groups[0]
    for r in range(16):  # every rank full but one seat
        for s in range(SMALL.seats_per_rank - 1):
            assert grp.seat(1000 + r * 10 + s, 64, 500, 0, r, False)
    grp.shared.extend(range(20))
    c._admit(grp, 0.0)
    assert len(grp.shared) == 4  # only 16 seats were free
    seated = grp.row[grp.fresh]
    assert sorted(seated.tolist()) == list(range(16))
    ranks = grp.seat_rank[grp.fresh]
    assert len(set(ranks.tolist())) == 16  # one row per rank: the round spread them


def test_align_waits_for_a_round_but_not_forever() -> None:
    c = EPCluster(Workload("w", np.full(40, 100), np.full(40, 50), 50), 16, SMALL,
                  EPMode("migrate+align", align_wait_s=1.0))
    grp = c.groups[0]
    for r in range(16):
        for s in range(SMALL.seats_per_rank):
            if (r, s) != (0, 0):
                assert grp.seat(1000 + r * 10 + s, 64, 500, 0, r, False)
    grp.shared.extend(range(40))
    c._admit(grp, 5.0)  # one free seat in 16 ranks, 4 a rank wanted: the round waits
    assert len(grp.shared) == 40 and not grp.fresh.any()
    c._admit(grp, 5.5)
    assert len(grp.shared) == 40
    c._admit(grp, 6.0)  # the seat has waited align_wait_s: it is filled
    assert len(grp.shared) == 39 and int(grp.fresh.sum()) == 1
