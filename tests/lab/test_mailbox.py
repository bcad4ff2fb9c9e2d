"""The Ray connector's report-to-report delays in the simulator (`ModeConfig.mailbox`): an
order reaches its donor half a tick after the plan, the moved row its receiver 1.5 ticks after
the export, its result the owner's task a tick after it finished, and a moved pair sits out 4
ticks of planning."""
from __future__ import annotations

import math

import numpy as np
import pytest

from batchgen_data.placement import PlacementConfig
from batchgen_lab.sim import Cluster, CostModel, EngineShape, ModeConfig
from batchgen_lab.sim.modes import mode_config
from batchgen_lab.sim.workload import Workload

COST = CostModel("test-linear", c0=2e-3, c_tok=50e-6, c_kv=2e-7, c_seq=0.4e-3,
                 bytes_per_token=4096, kv_capacity_tokens=200_000,
                 pcie_bytes_per_s=10e9, link_bytes_per_s=5e9)
SHAPE = EngineShape(4, max_num_batched_tokens=2048, block_size=16, max_finishes=1)
TICK = 0.05


def run(mailbox: bool) -> tuple[Cluster, float]:
    # a 1.5x straggler holds the job's long row (row 4); the speed rule sends it to the fast
    # actor once that is idle, so exactly one running row moves, and its result must travel
    # back to the straggler's task
    out = np.array([40, 50, 60, 70, 2000, 30, 40, 50])
    wl = Workload("mailbox", np.full(8, 64), out, 2048)
    placement = PlacementConfig(queue_depth=0, min_running_age=16, min_kv_gain_tokens=64,
                                max_receiver_slowdown=1.2, shed_slow_factor=1.3)
    mode = ModeConfig("migrate", batch_size=4, max_concurrent_batches=1, placement=placement,
                      migrate=True, tick_s=TICK, max_tasks_in_flight=1, ray_tasks=True,
                      mailbox=mailbox)
    c = Cluster(wl, 2, COST, SHAPE, mode, slowdown=[1.0, 1.5], plan=[[0], [1]])
    return c, c.run().bct_s


def test_delays_follow_the_tick() -> None:
    on = mode_config("migrate", 8, tick_s=0.4, mailbox=True)
    assert (on.order_delay_s, on.import_delay_s, on.deliver_delay_s, on.cooldown_s) == \
        pytest.approx((0.2, 0.6, 0.4, 1.6))
    off = mode_config("migrate", 8, tick_s=0.4)
    assert (off.order_delay_s, off.import_delay_s, off.deliver_delay_s, off.cooldown_s) == \
        (0.0, 0.0, 0.0, 0.0)


def test_a_moved_rows_result_pays_the_trip_home() -> None:
    direct, bct_direct = run(mailbox=False)
    mail, bct_mail = run(mailbox=True)
    for c in (direct, mail):
        # the long row ran last on the fast actor and every row was credited exactly once
        assert c.finished_by[4] == 0 and c.moved["running"] == 1
        assert c.num_finished == 8 and not np.isnan(c.finish).any()
    # what the row cannot avoid: 1.5 ticks without an engine on its way, and 1 tick for its
    # result to reach the owner; the half tick the order takes it spends stepping on the
    # straggler (slower, not idle), so the whole is less than 3 ticks more
    assert bct_direct + 2.5 * TICK - 1e-9 <= bct_mail <= bct_direct + 3.0 * TICK + 0.01
    # rows that never moved are credited when they finish, as before
    assert mail.finish[:4] == pytest.approx(direct.finish[:4])


def test_a_moved_pair_sits_out_the_cooldown(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen_lab.sim import cluster as cluster_mod

    now = [0.0]
    calls: list[tuple[float, set[int], list[tuple[int, int]]]] = []
    real_plan, real_tick = cluster_mod.plan_moves, Cluster._tick

    def plan(loads, summaries, cfg):  # type: ignore[no-untyped-def]
        moves = real_plan(loads, summaries, cfg)
        calls.append((now[0], {ld.engine_id for ld in loads}, [(m.src, m.dst) for m in moves]))
        return moves

    def tick(self: Cluster, t: float) -> None:
        now[0] = t
        real_tick(self, t)

    monkeypatch.setattr(cluster_mod, "plan_moves", plan)
    monkeypatch.setattr(Cluster, "_tick", tick)

    def window(mailbox: bool) -> tuple[list[set[int]], list[set[int]], set[int]]:
        calls.clear()
        c, _ = run(mailbox)
        moved = [(t, set(moves[0])) for t, _, moves in calls if moves]
        assert moved, "the long row never moved"
        t_move, pair = moved[0]
        assert not mailbox or c.planned_at[0] == c.planned_at[1] == t_move
        end = t_move + 4 * TICK - 1e-9
        return ([seen for t, seen, _ in calls if t_move < t < end],
                [seen for t, seen, _ in calls if t >= end], pair)

    # without the mailbox the pair is planned for again within 4 ticks of its move ...
    cool, _, pair = window(mailbox=False)
    assert any(pair <= seen for seen in cool)
    # ... with it, no planning round sees either engine for 4 ticks; later rounds do
    cool, after, pair = window(mailbox=True)
    assert all(not (pair & seen) for seen in cool)
    assert any(pair <= seen for seen in after)
