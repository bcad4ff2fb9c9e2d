"""Spark: bounded windows of in-flight requests over a stream of input batches.

Spark hands a task its rows a few at a time (`spark.sql.execution.arrow.maxRecordsPerBatch`).
Submitting one batch and waiting for it, as `predict_batch_udf` does, leaves the engine with a
batch no larger than that, and the slowest row of each batch idles everything else. Here many
input batches are submitted before any result is awaited, so the engine keeps its own batch full
while the connector hands results back either in input order (scalar UDFs must) or as they
finish (`mapInArrow` may).

Every row is a `Future`: a rejected row is a Future that already holds its exception, so error
rows travel through the same window as generated ones and keep their place in the order.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Callable, Iterable, Iterator, TypeVar

B = TypeVar("B")
Abandon = Callable[[list[Future]], None]


def in_input_order(batches: Iterable[B], submit: Callable[[B], list[Future]],
                   max_in_flight: int, abandon: Abandon | None = None) -> Iterator[list[Future]]:
    """Yield each input batch's futures, all finished, in input order.

    At most `max_in_flight` rows are held (pulled but not yet yielded); a batch is yielded as
    soon as it and every batch before it are done, so output streams while input is still read.
    Spark's iterator-UDF contract is met: output never runs ahead of the input consumed, and
    the totals match. If the consumer stops early (e.g. `df.limit`), `abandon` gets the rows
    still unfinished, so the engine can drop them instead of computing results nobody reads.
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight={max_in_flight!r}: must be >= 1")
    window: deque[list[Future]] = deque()
    held = 0
    try:
        for batch in batches:
            futures = submit(batch)
            window.append(futures)
            held += len(futures)
            while window and (held >= max_in_flight or all(f.done() for f in window[0])):
                head = window.popleft()
                held -= len(head)
                wait(head)
                yield head
        while window:
            head = window.popleft()
            wait(head)
            yield head
    finally:
        _abandon(abandon, (f for chunk in window for f in chunk))


def in_completion_order(batches: Iterable[B], submit: Callable[[B], list[Future]],
                        max_in_flight: int, abandon: Abandon | None = None
                        ) -> Iterator[list[tuple[B, int, Future]]]:
    """Yield finished rows as `(batch, row_index, future)` groups, as soon as they finish.

    Waits only when `max_in_flight` rows are unfinished or the input has run out; `abandon`
    as in `in_input_order`.
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight={max_in_flight!r}: must be >= 1")
    pending: dict[Future, tuple[B, int]] = {}

    def take(done: Iterable[Future]) -> list[tuple[B, int, Future]]:
        return [(*pending.pop(f), f) for f in done]

    try:
        for batch in batches:
            for i, fut in enumerate(submit(batch)):
                pending[fut] = (batch, i)
            while len(pending) >= max_in_flight:
                done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                yield take(done)
            done = [f for f in pending if f.done()]
            if done:
                yield take(done)
        while pending:
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            yield take(done)
    finally:
        _abandon(abandon, pending)


def _abandon(abandon: Abandon | None, futures: Iterable[Future]) -> None:
    # Not Future.cancel(): the engine thread may be resolving the same Future right now.
    unfinished = [f for f in futures if not f.done()]
    if abandon is not None and unfinished:
        abandon(unfinished)


class BatchSizeProbe:
    """Largest engine batch seen since this probe was made (debug_stats).

    Reads a copy of the engine's `batch_seqs_hist` and compares it with the copy taken at
    start, so the answer covers this task only, not earlier tasks on the same cached engine.
    """

    def __init__(self, engine: Any) -> None:
        self._stats = engine.stats
        self._start = self._hist()

    def _hist(self) -> dict[int, int]:
        return dict(getattr(self._stats, "batch_seqs_hist", None) or {})

    def max_batch_seqs(self) -> int:
        now = self._hist()
        grown = [n for n, steps in now.items() if steps > self._start.get(n, 0)]
        return max(grown, default=0)
