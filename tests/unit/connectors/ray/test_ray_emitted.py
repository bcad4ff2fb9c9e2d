"""The emitted-rows record (connectors/ray/emitted.py) without Ray: what a later attempt of a
call is told to replay as placeholders and what it must generate again."""
from __future__ import annotations

from batchgen_data.connectors.ray.emitted import EmissionLog, Replay, plan_replay


def log() -> EmissionLog:
    return EmissionLog(idle_exit_s=1e9)  # the idle exit must not end the test process


def test_a_first_attempt_finds_nothing() -> None:
    entries, alive, handed = log().open("task:digest:0", "attempt-1")
    assert (entries, alive, handed) == ([], {}, 0.0)


def test_the_last_yield_of_a_dead_attempt_is_generated_again() -> None:
    # written at 1, 2 and 5 s; the attempt was last heard from at 5.5 s
    entries = [((0,), 1.0, "a", 100), ((2, 3), 2.0, "a", 100), ((1,), 5.0, "a", 100)]
    plan = plan_replay(entries, {"a": 5.5}, 0.0, "b", settle_s=1.0)
    assert plan == [Replay((0,), True),  # handed over by 2.0, 3.5 s before the end
                    Replay((2, 3), False),  # handed over by 5.0: 0.5 s, not settled
                    Replay((1,), False)]  # never known to be handed over


def test_a_finished_call_is_settled_once_old_enough() -> None:
    entries = [((0,), 1.0, "a", 100), ((1,), 2.0, "a", 100)]
    assert [r.placeholder for r in plan_replay(entries, {"a": 9.0}, 6.0, "b", 1.0)] == \
        [True, True]
    assert [r.placeholder for r in plan_replay(entries, {"a": 6.5}, 6.0, "b", 1.0)] == \
        [True, False]


def test_the_same_process_retrying_trusts_all_it_handed_over() -> None:
    entries = [((0,), 1.0, "a", 100), ((1,), 1.01, "a", 100)]
    assert all(r.placeholder for r in plan_replay(entries, {"a": 1.01}, 0.0, "a", 1.0))


def test_rows_too_large_to_travel_inline_are_generated_again() -> None:
    # a row in the object store of a lost node is lost with it: a placeholder would replace it
    entries = [((0,), 1.0, "a", 90 * 1024), ((1,), 2.0, "a", 10)]
    plan = plan_replay(entries, {"a": 9.0}, 3.0, "b", 1.0, inline_bytes=100 * 1024)
    assert [r.placeholder for r in plan] == [False, True]


def test_the_log_keeps_order_writers_and_the_finish() -> None:
    rec = log()
    rec.add("k", "a", (3,), 10)
    rec.add("k", "a", (0, 1), 10)
    rec.beat("a")
    entries, alive, handed = rec.open("k", "b")
    assert [e[0] for e in entries] == [(3,), (0, 1)]
    assert set(alive) == {"a"} and alive["a"] >= entries[-1][1]
    assert handed == 0.0  # not finished: the last entry's outputs are not known handed over
    rec.finish("k", "a")
    assert rec.open("k", "b")[2] >= entries[-1][1]
    assert rec.stats() == {"calls": 1, "writes": 2, "rows": 3}
