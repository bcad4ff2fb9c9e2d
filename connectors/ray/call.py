"""One `BatchGenPredictor.__call__`: an input batch's rows to the engine and back out, in the
order the predictor's `stream` asks for.

* completion order (`stream=True`): rows leave as they finish, each yield written to the job's
  emitted-rows record first (`ray/emitted.py`); a retried call goes through the record of its
  earlier attempts first, yielding placeholders where Ray keeps the dead attempt's outputs and
  the same rows again where it may not, then the rest as they finish (docs/guarantees.md);
* input order (`"ordered"`): one row per yield, the n-th output of a task is its n-th row;
* whole batches (`False`): one yield with every row, in input order, as `ray.data.llm` does.

The rows go through the predictor's `handler.RowHandler`, whatever their kind; the poison-row
record's verdict on them (`ray/poison.py`) decides which run alone and which are not run again.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import pyarrow as pa

from batchgen_data.connectors.handler import RowHandler
from batchgen_data.connectors.ray.poison import PoisonCall

PLACEHOLDER = "batchgen: placeholder for a row an earlier attempt of this task already emitted"


class Call:
    """The rows of one input batch in flight: their Futures by row index in the batch."""

    def __init__(self, rows: RowHandler, table: pa.Table, poison: PoisonCall | None) -> None:
        self.rows = rows
        self.table = table
        self.poison = poison  # this call's entry in the poison-row record, if the job keeps one
        self.pending: dict[Future, int] = {}

    def whole(self) -> Iterator[pa.Table]:
        self._submit(self.table.to_pylist())
        wait(list(self.pending))
        yield self._finished(list(self.pending))

    def in_input_order(self) -> Iterator[pa.Table]:
        self._submit(self.table.to_pylist())
        for fut in sorted(self.pending, key=self.pending.__getitem__):
            wait([fut])
            yield self._finished([fut])

    def in_completion_order(self, record: Any) -> Iterator[pa.Table]:
        """Rows as they finish; `record`: this call's `emitted.CallRecord` (or `NO_RECORD`)."""
        rows = self.table.to_pylist()
        record = record.call(rows)
        self._submit(rows)  # generating while the record is read
        replay = record.replay()
        fut_of = {i: f for f, i in self.pending.items()}
        settled = [fut_of.pop(i) for r in replay if r.placeholder for i in r.rows]
        for f in settled:  # Ray has these rows from an earlier attempt: stop generating them
            del self.pending[f]
        self.rows.abandon(settled)
        for r in replay:  # the earlier attempts' outputs, at the indices Ray has them
            if r.placeholder:
                yield self.rows.placeholders(self.table, list(r.rows), PLACEHOLDER)
                continue
            futs = [fut_of[i] for i in r.rows]
            wait(futs)
            yield self._finished(futs)
        while self.pending:
            done, _ = wait(list(self.pending), return_when=FIRST_COMPLETED)
            indices = sorted(self.pending[f] for f in done)
            out = self._finished(done)
            record.add(indices, max(out.slice(k, 1).nbytes for k in range(out.num_rows)))
            yield out
        record.finish()

    def abandon(self) -> None:
        """Stop the rows still pending (the task failed, or was cancelled)."""
        self.rows.abandon(self.pending)

    def _submit(self, rows: list[dict[str, Any]]) -> None:
        """The batch's rows to the engine, in input order; with a poison-row record, rows it
        blames become row errors and suspects run alone."""
        for i, row in enumerate(rows):
            if self.poison is None:
                self.pending[self.rows.submit(row)] = i
            elif i in self.poison.verdict.blamed:  # it killed engines before: not run
                self.pending[self.rows.reject(self.poison.verdict.blamed[i])] = i
            else:
                fut = self.rows.submit(row, alone=i in self.poison.verdict.quarantined)
                self.poison.sent(self.rows.request_id(fut), i)
                self.pending[fut] = i

    def _finished(self, done: Iterable[Future]) -> pa.Table:
        """Finished rows, taken out of `pending`, in input order, with their outputs."""
        finished = sorted((self.pending.pop(f), f) for f in done)
        return self.rows.attach(self.table, [i for i, _ in finished],
                                [self.rows.outcome(f) for _, f in finished])
