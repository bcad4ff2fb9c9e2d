"""The poison-row record's evidence rule (connectors/poison.py) and Ray's log of it
(connectors/ray/poison.py) without Ray: a row is run alone once a death names it, and is
blamed only when it was named at two deaths, one of them alone in the failed step."""
from __future__ import annotations

from batchgen_data.connectors.poison import DEATHS, PoisonBook, poison_message
from batchgen_data.connectors.ray.poison import PoisonLog


def test_no_death_no_verdict() -> None:
    v = PoisonBook().verdict()
    assert not v.blamed and not v.quarantined
    assert PoisonBook().record([], alone=False) is None  # a death that named none of ours


def test_a_suspect_runs_alone_and_is_blamed_after_a_second_death_alone() -> None:
    book = PoisonBook()
    book.record([3, 5, 8], alone=False)  # a step of three rows failed, nothing runs again
    v = book.verdict()
    assert v.quarantined == {3, 5, 8} and not v.blamed
    book.record([5], alone=True)  # run alone, row 5 failed again
    v = book.verdict()
    assert v.blamed == {5: poison_message(2)} and v.quarantined == {3, 8}
    assert DEATHS == 2


def test_one_death_alone_is_not_enough_nor_two_never_alone() -> None:
    alone_once = PoisonBook()
    alone_once.record([1], alone=True)
    assert alone_once.verdict().quarantined == {1} and not alone_once.verdict().blamed
    crowded = PoisonBook()  # a flaky device: the same rows in flight at every death
    for _ in range(4):
        crowded.record([1, 2], alone=False)
    assert crowded.verdict().quarantined == {1, 2} and not crowded.verdict().blamed


def test_the_log_keeps_each_calls_deaths_in_order() -> None:
    log = PoisonLog(idle_exit_s=1e9)  # the idle exit must not end the test process
    assert log.read("task:digest:0") == []
    log.add("task:digest:0", (2, 4), False)
    log.add("task:digest:0", (4,), True)
    log.add("task:digest:1", (0,), False)
    assert log.read("task:digest:0") == [((2, 4), False), ((4,), True)]
    assert log.read("task:digest:1") == [((0,), False)]
