"""The row handler a connector drives: one Protocol, one lifecycle, one rule for a row error.

Ray's `BatchGenPredictor`, Spark's `TaskSession` and the command hand their rows to a
`RowHandler` and never ask which kind it is: generation rows (`rows.GenerationRows`), program
rows (`programs.ProgramRows`) or pooling rows (`pooling_rows.PoolingRows`); `row_kinds.RowKind`
picks one. Every kind is a `RowLifecycle`, so they cannot disagree about what a row error is
(docs/row-errors.md):

* an **engine failure** is the engine loop dying (`EngineDeadError`). No row is at fault and the
  engine never recovers, so the task fails (after `on_engine_dead` lets the connector drop its
  engine) and the data engine retries it on a fresh one;
* anything else that goes wrong with one row, while it is validated, tokenized, submitted or
  run, is **that row's error**: its `error` column says what happened and the other rows go
  on. With `on_error="raise"` the first row error fails the task instead.

A kind supplies only what differs: how a row reaches the engine (`_start`), what a finished
row's columns are (`_columns`, `_error_columns`), and the output schema (`attach`,
`output_schema`). A lifecycle is thread-safe: a Ray actor serves several input batches at once
through one.
"""
from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa

from batchgen_data.core.errors import EngineDeadError

log = logging.getLogger(__name__)
ON_ERROR = ("row", "raise")


class RowError(ValueError):
    """A row the engine cannot take; its message becomes the row's `error` value."""


def check_on_error(on_error: str) -> str:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error={on_error!r}: use one of {ON_ERROR}")
    return on_error


def failed_future(exc: BaseException) -> Future:
    """A finished Future holding `exc`: the stand-in for a row the engine never sees."""
    fut: Future = Future()
    fut.set_exception(exc)
    return fut


def error_message(exc: BaseException) -> str:
    """A row's `error` value: a validation message as is, anything unexpected with its type."""
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


@runtime_checkable
class RowHandler(Protocol):
    """What a connector does with the rows of one engine: Futures in, output columns out."""

    driver: Any  # the `EngineDriver` the rows run on

    def submit(self, row: Mapping[str, Any], key: Any = None, alone: bool = False) -> Future:
        """The row to the engine; a row error comes back as a finished Future holding it."""

    def reject(self, message: str) -> Future:
        """A row refused before it is built (a duplicate id): a row error like any other."""

    def outcome(self, fut: Future) -> dict[str, Any]:
        """A finished row's output column values; raises for the engine's failure."""

    def abandon(self, futures: Iterable[Future]) -> None:
        """Stop running rows nobody will read."""

    def request_id(self, fut: Future) -> str | None:
        """The engine's request id of a row in flight (None when it has no single one)."""

    def is_engine_dead(self, exc: BaseException | None) -> bool:
        """Whether `exc` is the engine's failure, not a row's."""

    def output_schema(self) -> pa.Schema | None:
        """The columns `attach` appends (None: whatever the rows hold)."""

    def attach(self, table: pa.Table, indices: Sequence[int],
               rows: Sequence[Mapping[str, Any]]) -> pa.Table:
        """Input rows `indices` of `table`, all columns kept, the output columns appended."""

    def placeholders(self, table: pa.Table, indices: Sequence[int], message: str) -> pa.Table:
        """Rows of the output's shape for rows not run, `message` in their `error`."""

    def close(self) -> None:
        """Let go of what the handler started (threads); the driver is the caller's."""


class RowLifecycle(ABC):
    """build → submit → outcome → abandon, the same for every kind of row (a `RowHandler`)."""

    def __init__(self, driver: Any, on_error: str = "row", request_prefix: str = "row",
                 on_engine_dead: Callable[[BaseException], None] | None = None) -> None:
        self.driver = driver
        self.on_error = check_on_error(on_error)
        self.on_engine_dead = on_engine_dead
        self._prefix = request_prefix
        self._ids = itertools.count()  # next() is atomic: calls come from several threads
        self._request_ids: dict[Future, str] = {}  # in flight, for `abandon`

    # ---- what a kind supplies ----------------------------------------------------------------
    @abstractmethod
    def _start(self, row: Mapping[str, Any], key: Any, alone: bool
               ) -> tuple[Future, str | None]:
        """Hand `row` to the engine: its Future and request id (None: no single request).
        Raises for a row that cannot run (a `RowError` names why)."""

    @abstractmethod
    def _columns(self, result: Any) -> dict[str, Any]:
        """Output columns of a finished row's result (an error row when it does not fit)."""

    @abstractmethod
    def _error_columns(self, message: str) -> dict[str, Any]:
        """Output columns of a row that produced nothing, `message` in `error`."""

    @abstractmethod
    def output_schema(self) -> pa.Schema | None: ...

    @abstractmethod
    def attach(self, table: pa.Table, indices: Sequence[int],
               rows: Sequence[Mapping[str, Any]]) -> pa.Table: ...

    def _abort(self, futures: list[Future], request_ids: list[str]) -> None:
        """Stop the engine's work for abandoned rows (their request ids, as `_start` gave)."""
        if not request_ids or self.driver.dead is not None:
            return

        def abort_all(engine: Any) -> None:
            for rid in request_ids:
                engine.abort(rid)  # False when it finished meanwhile

        self.driver.call(abort_all)

    def close(self) -> None:
        pass

    # ---- the lifecycle -----------------------------------------------------------------------
    def next_request_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def submit(self, row: Mapping[str, Any], key: Any = None, alone: bool = False) -> Future:
        """A row error comes back as a finished Future holding it (raised at once with
        on_error="raise"); `key` seeds unseeded sampling, so a retried task or a moved row
        samples the same tokens. `alone`: the engine runs it in steps of its own (a row the
        poison-row record suspects, connectors/poison.py), where the kind can."""
        try:
            fut, rid = self._start(row, key, alone)
        except Exception as e:  # noqa: BLE001 - sorted by the rule above
            return failed_future(RowError(self._row_error(e)))
        if rid is not None:
            self._request_ids[fut] = rid
        return fut

    def reject(self, message: str) -> Future:
        return failed_future(RowError(self._row_error(RowError(message))))

    def outcome(self, fut: Future) -> dict[str, Any]:
        """Raises for an engine failure (and for a row error with on_error="raise")."""
        self._request_ids.pop(fut, None)
        exc = fut.exception()
        if exc is not None:
            return self._error_columns(self._row_error(exc))
        row = self._columns(fut.result())
        if row["error"] is not None and self.on_error == "raise":
            raise RowError(row["error"])
        return row

    def abandon(self, futures: Iterable[Future]) -> None:
        """Stop rows nobody will read (the task failed, was cancelled, or its consumer stopped
        early); a row that finished meanwhile is left alone."""
        futures = list(futures)
        self._abort(futures, [self._request_ids.pop(f) for f in futures
                              if f in self._request_ids])

    def request_id(self, fut: Future) -> str | None:
        return self._request_ids.get(fut)

    def is_engine_dead(self, exc: BaseException | None) -> bool:
        return isinstance(exc, EngineDeadError)

    def placeholders(self, table: pa.Table, indices: Sequence[int], message: str) -> pa.Table:
        return self.attach(table, indices, [self._error_columns(message)] * len(indices))

    def _row_error(self, exc: BaseException) -> str:
        """The one rule: the `error` value of a row that failed with `exc`. Raises instead for
        the engine's failure, and for any row error with on_error="raise"."""
        if isinstance(exc, EngineDeadError):
            log.error("batchgen: the engine died (%r); failing the task so it is retried", exc)
            if self.on_engine_dead is not None:
                self.on_engine_dead(exc)
            raise exc
        if self.on_error == "raise":
            if isinstance(exc, RowError):
                raise exc
            raise RowError(error_message(exc)) from exc
        return error_message(exc)
