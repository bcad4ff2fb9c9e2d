"""The simulator hands input batches to actors as Ray Data 2.60 does (sim/modes.py, rules 1-5):
fewest tasks in flight first, no more than the limit, actors that come up together share the
queued batches, and in task modes a batch holds its slot until its slowest row is done."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from batchgen_lab.sim import Cluster, CostModel, EngineShape, mode_config
from batchgen_lab.sim.result import home_last
from batchgen_lab.sim.workload import Workload

from batchgen_lab.ray_emulated_sim import agreement, measured_start, per_actor_gap  # noqa: E402

LINEAR = CostModel("test-linear", c0=2e-3, c_tok=50e-6, c_kv=2e-7, c_seq=0.4e-3,
                   bytes_per_token=4096, kv_capacity_tokens=400_000,
                   pcie_bytes_per_s=10e9, link_bytes_per_s=5e9)
SHAPE = EngineShape(max_num_seqs=8, max_num_batched_tokens=4096, block_size=16)


def flat(rows: int, out: int = 20) -> Workload:
    return Workload("flat", np.full(rows, 16), np.full(rows, out), out + 1)


def run(wl: Workload, actors: int, name: str = "static", calls: int = 1, in_flight: int = 2,
        start_at: list[float] | None = None, batch_size: int = 4,
        plan: list[list[int]] | None = None, **kw: object) -> Cluster:
    mode = mode_config(name, SHAPE.max_num_seqs, batch_size=batch_size,
                       max_concurrent_batches=calls, max_tasks_in_flight=in_flight,
                       window_calls=calls, **kw)
    cluster = Cluster(wl, actors, LINEAR, SHAPE, mode, start_at=start_at, plan=plan)
    cluster.run()
    return cluster


def test_each_batch_goes_to_the_actor_with_fewest_in_flight() -> None:
    # 3 actors up at once, limit 2 each, 6 batches: all bound at 0, round robin by count
    c = run(flat(24), 3)
    assert c.batch_home == [0, 1, 2, 0, 1, 2]
    assert np.all(c.batch_bound_at == 0.0)


def test_actors_that_come_up_together_share_the_queue_and_the_first_takes_its_limit() -> None:
    # actor 0 is up first and takes its limit (4 batches); actors 1 and 2 come up together
    # and share the other 4 by the fewest-in-flight rule instead of the first taking them all
    c = run(flat(32), 3, calls=2, in_flight=4, start_at=[0.0, 0.01, 0.01])
    assert c.batch_home[:4] == [0, 0, 0, 0]
    assert sorted(c.batch_home[4:]) == [1, 1, 2, 2]
    assert c.batch_home[4:6] == [1, 2]
    assert np.all(c.batch_bound_at[4:] == 0.01)


def test_a_task_holds_its_slot_until_its_slowest_row_then_the_next_batch_is_bound() -> None:
    # one actor, one task at a time: batch 1 is bound only when batch 0's long row is done
    wl = Workload("skewed", np.full(8, 16), np.array([200, 2, 2, 2, 2, 2, 2, 2]), 201)
    c = run(wl, 1, name="continuous", calls=1, in_flight=1, ray_tasks=True)
    assert c.batch_bound_at[1] == pytest.approx(c.finish[0])
    assert c.finish[4:].min() > c.finish[0]
    # the same mode with its row-level window binds both batches at once
    window = run(wl, 1, name="continuous")
    assert window.batch_bound_at[1] == 0.0 and window.finish[4:].max() < window.finish[0]


def test_queued_tasks_wait_behind_the_running_calls_in_order() -> None:
    # limit 2 in flight, 1 call at a time: the second bound batch waits in the actor's queue
    c = run(flat(16), 2, calls=1, in_flight=2)
    assert c.batch_home == [0, 1, 0, 1]
    assert c.finish[8:12].min() >= c.finish[0:4].max()  # batch 2 starts after batch 0 ends


def test_home_last_and_ray_like_streaming_modes_finish_every_row() -> None:
    assert home_last(np.array([1.0, 5.0, 3.0]), np.array([0, 0, 2]), 3)[0] == 5.0
    wl = flat(40)
    for name in ("late-bind", "migrate"):
        c = run(wl, 2, name=name, calls=2, in_flight=2, ray_tasks=True, tick_s=0.05)
        assert np.isfinite(c.finish).all()
        assert max(c.batches_open) == 0 and c.mode.by_task


def test_measured_start_groups_actors_into_waves_and_the_verdict() -> None:
    # two actors seen first, then five within 0.4 s of each other, one never got a batch
    first = [2.4, 1.5, 2.5, 2.6, 1.52, 2.7, 2.8, None]
    assert measured_start(first, gap_s=0.4) == [2.4, 1.5, 2.4, 2.4, 1.5, 2.4, 2.4, 2.4]
    assert agreement(105.0, 100.0) == "PASS" and agreement(111.0, 100.0) == "FAIL"
    assert per_actor_gap([10.0, 22.0], [20.0, 10.0]) == 0.1  # matched by rank


def test_ray_tasks_modes_take_the_connectors_window() -> None:
    m = mode_config("migrate", 1024, batch_size=32, ray_tasks=True)
    assert m.by_task and m.max_concurrent_batches == 64 and m.tasks_in_flight == 64
    s = mode_config("continuous", 1024, batch_size=32, ray_tasks=True)
    assert s.tasks_in_flight == 128  # no coordinator: Ray's default 2x, batches queue
    assert not mode_config("late-bind", 64).by_task
    assert not mode_config("static", 64, ray_tasks=True).ray_tasks


def test_replaying_the_rules_own_dispatch_gives_the_same_run() -> None:
    rng = np.random.default_rng(3)
    wl = Workload("mixed", np.full(48, 16), rng.integers(2, 60, 48), 61)
    ruled = run(wl, 3, calls=1, in_flight=2)
    plan: list[list[int]] = [[] for _ in range(3)]
    for b in sorted(range(12), key=lambda b: (ruled.batch_bound_at[b], b)):
        plan[ruled.batch_home[b]].append(b)
    replayed = run(wl, 3, calls=1, in_flight=2, plan=plan)
    assert replayed.batch_home == ruled.batch_home
    np.testing.assert_allclose(replayed.finish, ruled.finish)
    # a different plan is followed, not re-decided: everything on actor 0
    alone = run(wl, 3, calls=1, in_flight=2, plan=[list(range(12)), [], []])
    assert set(alone.batch_home) == {0}
    with pytest.raises(ValueError, match="plan"):
        run(wl, 3, calls=1, in_flight=2, plan=[[0, 1], [2], []])  # batches missing
    with pytest.raises(ValueError, match="plan"):
        run(wl, 3, name="continuous", plan=plan)  # a row window has no tasks to replay
