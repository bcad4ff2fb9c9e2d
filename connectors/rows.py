"""One row's life in a connector: build → seed → submit → outcome → abandon.

Ray's `BatchGenPredictor` and Spark's `TaskSession` both hand their rows to a `RowLifecycle`, so
the two connectors cannot disagree about what a row error is. The rule (docs/row-errors.md):

* an **engine failure** is the engine loop dying (`EngineDeadError`). No row is at fault and the
  engine never recovers, so the task fails (after `on_engine_dead` lets the connector drop its
  engine) and the data engine retries it on a fresh one;
* anything else that goes wrong with one row, while it is validated, tokenized, submitted or
  generated, is **that row's error**: its `error` column says what happened and the other rows
  go on. With `on_error="raise"` the first row error fails the task instead.

The lifecycle is thread-safe: a Ray actor serves several input batches at once through one.
"""
from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

from batchgen_data.connectors.common import (
    RequestBuilder, RowError, error_row, lora_kwargs, result_row, seeded)
from batchgen_data.connectors.programs import (
    program_error_row, program_output_schema, program_result_row, program_row_key, step_seed)

log = logging.getLogger(__name__)
ON_ERROR = ("row", "raise")


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


def _engine_dead_error() -> type[BaseException]:
    from batchgen_data.engine.driver import EngineDeadError  # imports torch: executor side only

    return EngineDeadError


class RowLifecycle:
    """Rows of one engine in, Futures out; finished Futures become output column values."""

    def __init__(self, driver: Any, builder: RequestBuilder, base_seed: int,
                 on_error: str = "row", request_prefix: str = "row",
                 on_engine_dead: Callable[[BaseException], None] | None = None,
                 program: Any = None) -> None:
        self.driver = driver
        self.builder = builder
        self.base_seed = base_seed
        self.on_error = check_on_error(on_error)
        self.on_engine_dead = on_engine_dead
        self._dead = _engine_dead_error()
        self._prefix = request_prefix
        self._ids = itertools.count()  # next() is atomic: calls come from several threads
        # HF fast tokenizers fail with "Already borrowed" when threads share one
        self._build_lock = threading.Lock()
        self._request_ids: dict[Future, str] = {}  # in flight, for `abandon`
        self._watch = EmptyAnswerWatch.of(driver.engine)
        # with a per-row program each row runs it instead of one request (connectors/programs.py)
        self.programs = self._start_programs(program) if program is not None else None
        self.program_schema = program_output_schema(program)

    def _start_programs(self, program: Any) -> Any:
        from batchgen_data.programs.driven import DrivenPrograms  # imports the engine side

        return DrivenPrograms(
            self.driver, program, self.builder.default_params, self._build_lock,
            seed_for=lambda key, step, slot: step_seed(self.base_seed, key, step, slot),
            prefix=f"{self._prefix}-program", is_engine_dead=lambda e: isinstance(e, self._dead),
            lora_for=self.builder.lora_for)

    def submit(self, row: Mapping[str, Any], key: Any = None, alone: bool = False) -> Future:
        """build → seed → submit. A row error comes back as a finished Future holding it
        (raised at once with on_error="raise"); `key` seeds unseeded sampling (default: the
        prompt's token ids), so a retried task or a moved row samples the same tokens.
        `alone`: the engine runs it in steps of its own (a row the poison-row record suspects:
        connectors/poison.py; a program row ignores it)."""
        if self.programs is not None:
            # the whole row goes to the program; its failures arrive through the Future
            return self.programs.submit(dict(row), program_row_key(row) if key is None else key)
        try:
            with self._build_lock:
                req = self.builder.build(row)
            seed_key = req.prompt_token_ids if key is None else key
            params = seeded(req.params, self.base_seed, seed_key)
            rid = f"{self._prefix}-{next(self._ids)}"
            extra = {"alone": True} if alone else {}
            fut = self.driver.submit(req.prompt_token_ids, params, request_id=rid,
                                     prompt=req.prompt, **lora_kwargs(req.lora), **extra)
        except Exception as e:  # noqa: BLE001 - sorted by the rule above
            if isinstance(e, self._dead):
                self._engine_failed(e)
                raise
            if self.on_error == "raise":
                raise RowError(error_message(e)) from e
            return failed_future(RowError(error_message(e)))
        self._request_ids[fut] = rid
        return fut

    def is_engine_dead(self, exc: BaseException | None) -> bool:
        """Whether `exc` is the engine's failure (`EngineDeadError`), not a row's."""
        return isinstance(exc, self._dead)

    def request_id(self, fut: Future) -> str | None:
        """The engine's request id of a row in flight (None for a row error or a program)."""
        return self._request_ids.get(fut)

    def reject(self, message: str) -> Future:
        """A row refused before it is built (e.g. a duplicate id): a row error like any other."""
        if self.on_error == "raise":
            raise RowError(message)
        return failed_future(RowError(message))

    def outcome(self, fut: Future) -> dict[str, Any]:
        """Output column values of a finished row; raises for an engine failure (and for a
        row error with on_error="raise")."""
        self._request_ids.pop(fut, None)
        exc = fut.exception()
        if exc is None and self.programs is not None:
            row = program_result_row(fut.result(), self.program_schema)
            if row["error"] is not None and self.on_error == "raise":
                raise RowError(row["error"])
            return row
        if exc is None:
            row = result_row(fut.result())
            self._watch.saw(row, self.builder.prompts_as_chat)
            return row
        if isinstance(exc, self._dead):
            self._engine_failed(exc)
            raise exc
        if self.on_error == "raise":
            if isinstance(exc, RowError):
                raise exc
            raise RowError(error_message(exc)) from exc
        if self.programs is not None:
            return program_error_row(error_message(exc))
        return error_row(error_message(exc))

    def abandon(self, futures: Iterable[Future]) -> None:
        """Stop generating rows nobody will read (the task failed, was cancelled, or its
        consumer stopped early); a row that finished meanwhile is left alone."""
        if self.programs is not None:
            self.programs.abandon(futures)
            return
        rids = [self._request_ids.pop(f) for f in list(futures) if f in self._request_ids]
        if not rids or getattr(self.driver, "dead", None) is not None:
            return

        def abort_all(engine: Any) -> None:
            for rid in rids:
                engine.abort(rid)  # False when it finished meanwhile

        self.driver.call(abort_all)

    def _engine_failed(self, exc: BaseException) -> None:
        log.error("batchgen: the engine died (%r); failing the task so it is retried", exc)
        if self.on_engine_dead is not None:
            self.on_engine_dead(exc)


class EmptyAnswerWatch:
    """Warns once per engine when far more rows come back empty than a working setup gives.

    An instruct model sent a bare prompt often ends its answer at once ('' with finish_reason
    "stop"); the job still succeeds, so only the log can say so. One watch per engine, shared by
    every task that uses it (Spark keeps an engine across tasks).
    """

    MIN_ROWS = 20
    MAX_EMPTY_FRACTION = 0.2
    _by_engine: "weakref.WeakKeyDictionary[Any, EmptyAnswerWatch]" = weakref.WeakKeyDictionary()
    _registry_lock = threading.Lock()

    def __init__(self) -> None:
        self.finished = 0
        self.empty = 0
        self.warned = False
        self._lock = threading.Lock()

    @classmethod
    def of(cls, engine: Any) -> "EmptyAnswerWatch":
        with cls._registry_lock:
            watch = cls._by_engine.get(engine)
            if watch is None:
                watch = cls._by_engine[engine] = cls()
            return watch

    def saw(self, row: Mapping[str, Any], prompts_as_chat: bool) -> None:
        with self._lock:
            if self.warned:
                return
            self.finished += 1
            self.empty += row["generated_text"] == "" and row["finish_reason"] == "stop"
            if self.finished < self.MIN_ROWS or self.empty <= self.MAX_EMPTY_FRACTION * self.finished:
                return
            self.warned = True
            empty, finished = self.empty, self.finished
        how = ("plain prompts were sent without the chat template: keep "
               "apply_chat_template=True (the default) or give a `messages` column"
               if not prompts_as_chat else
               "check that the model is the one meant and that its chat template fits it; "
               "SamplingParams(min_tokens=...) forces a minimum length")
        log.warning("batchgen: %d of the first %d finished rows have an empty generated_text "
                    "(finish_reason 'stop'): the model ended its answer at once. Fix: %s.",
                    empty, finished, how)
