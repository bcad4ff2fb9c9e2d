"""The deep window and late-binding options of `BatchGenProcessorConfig`, as pure functions
(no Ray cluster is started)."""
from __future__ import annotations

import pytest

pytest.importorskip("ray")

from batchgen_data.connectors.ray_data import window_batches  # noqa: E402
from batchgen_data.connectors.ray.processor import BatchGenProcessorConfig  # noqa: E402


@pytest.mark.parametrize("seats, batch, depth, want", [
    (256, 32, 2.0, 16), (256, 32, 1.0, 8), (1024, 32, 2.0, 64), (4, 4, 2.0, 2),
    (5, 4, 1.0, 2), (8, 64, 2.0, 1), (100, 32, 1.5, 5)])
def test_window_batches_covers_depth_times_the_seats(seats: int, batch: int, depth: float,
                                                      want: int) -> None:
    assert window_batches(seats, batch, depth) == want
    assert want * batch >= seats * depth  # the window is at least that deep


def test_window_batches_is_capped_for_tiny_batches() -> None:
    # a 4-row CLI job on 2 actors gets batches of 2: 256 seats would ask for 256 threads
    assert window_batches(256, 2, 2.0) == 128
    assert window_batches(256, 4, 2.0) == 128
    assert window_batches(256, 8, 2.0) == 64


@pytest.mark.parametrize("bad", [(0, 32, 2.0), (8, 0, 2.0), (8, 32, 0.0), (8, 32, -1.0)])
def test_window_batches_refuses_bad_values(bad: tuple[int, int, float]) -> None:
    with pytest.raises(ValueError):
        window_batches(*bad)


def test_the_pool_serves_a_window_of_twice_the_seats_by_default() -> None:
    cfg = BatchGenProcessorConfig(concurrency=2, batch_size=16,
                                  engine_kwargs={"max_num_seqs": 64})
    pool = cfg.map_batches_kwargs("j")["compute"]
    assert pool.max_concurrent_calls_per_actor == 8  # 2 x 64 seats / 16 rows per batch
    assert pool.max_tasks_in_flight_per_actor == 8  # nothing queued where no engine sees it
    deeper = BatchGenProcessorConfig(concurrency=2, batch_size=16, window_depth=3.0,
                                     engine_kwargs={"max_num_seqs": 64})
    assert deeper.map_batches_kwargs()["compute"].max_concurrent_calls_per_actor == 12
    fixed = BatchGenProcessorConfig(concurrency=2, batch_size=16, max_concurrent_batches=3,
                                    engine_kwargs={"max_num_seqs": 64})
    assert fixed.map_batches_kwargs()["compute"].max_concurrent_calls_per_actor == 3


@pytest.mark.parametrize("migration, late, want_late", [
    (None, None, True), (False, None, False), (False, True, True), (True, False, False),
    (True, None, True)])
def test_late_binding_follows_migration_unless_set(migration: bool | None, late: bool | None,
                                                   want_late: bool) -> None:
    cfg = BatchGenProcessorConfig(concurrency=2, migration=migration, late_binding=late)
    kw = cfg.constructor_kwargs()
    assert kw["late_binding"] is want_late and kw["migration"] is cfg.migration_on
    # either one runs a coordinator, so no batch waits queued at a busy actor
    in_flight = cfg.map_batches_kwargs()["compute"].max_tasks_in_flight_per_actor
    assert (in_flight is not None) is (want_late or cfg.migration_on)


def test_a_window_depth_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="window_depth"):
        BatchGenProcessorConfig(window_depth=0)


@pytest.mark.parametrize("task", ["embed", "classify", "score"])
def test_a_pooling_pool_serves_about_one_step_of_rows_per_actor(task: str) -> None:
    # a pooled row leaves after one pass: the window follows the token budget (128 tokens a
    # row), not max_num_seqs, so a small job's batches spread over the actors
    cfg = BatchGenProcessorConfig(concurrency=2, batch_size=32, task_type=task,
                                  engine_kwargs={"max_num_batched_tokens": 4096,
                                                 "max_num_seqs": 1024})
    pool = cfg.map_batches_kwargs("j")["compute"]
    assert pool.max_concurrent_calls_per_actor == 2  # 2 x 32 rows of a step / 32 a batch
    assert pool.max_tasks_in_flight_per_actor == 3  # and one batch queued at hand
    wide = BatchGenProcessorConfig(concurrency=2, batch_size=32, task_type=task,
                                   engine_kwargs={"max_num_batched_tokens": 16384})
    assert wide.map_batches_kwargs()["compute"].max_concurrent_calls_per_actor == 8
    fixed = BatchGenProcessorConfig(concurrency=2, batch_size=32, task_type=task,
                                    max_concurrent_batches=5, max_tasks_in_flight_per_actor=9)
    pool = fixed.map_batches_kwargs()["compute"]
    assert (pool.max_concurrent_calls_per_actor, pool.max_tasks_in_flight_per_actor) == (5, 9)
    gen = BatchGenProcessorConfig(concurrency=2, batch_size=32,
                                  engine_kwargs={"max_num_batched_tokens": 4096,
                                                 "max_num_seqs": 1024})
    assert gen.map_batches_kwargs()["compute"].max_concurrent_calls_per_actor == 64
