"""Generation rows: a row → one request → the generation columns (a `handler.RowLifecycle`).

The row becomes a request through `common.RequestBuilder` (validated, chat-templated, seeded
from the row), runs on the engine, and its `RequestOutput` becomes the output columns both
connectors append to every input row: `generated_text`, `generated_token_ids`,
`num_prompt_tokens`, `num_generated_tokens`, `finish_reason`, `error` (null when fine), and the
logprobs and n > 1 columns of row_extras.py.
"""
from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import pyarrow as pa

from batchgen_data.connectors import row_extras
from batchgen_data.connectors.cells import with_outputs
from batchgen_data.connectors.common import RequestBuilder, lora_kwargs, seeded
from batchgen_data.connectors.image_rows import images_kwargs
from batchgen_data.connectors.handler import RowLifecycle

log = logging.getLogger(__name__)


def output_schema() -> pa.Schema:
    """Arrow schema of the columns both connectors append to every input row."""
    return pa.schema([
        pa.field("generated_text", pa.string()),
        pa.field("generated_token_ids", pa.list_(pa.int32())),
        pa.field("num_prompt_tokens", pa.int32()),
        pa.field("num_generated_tokens", pa.int32()),
        pa.field("finish_reason", pa.string()),
        pa.field("error", pa.string()),
        *row_extras.output_fields(),  # logprobs, top_logprobs, samples (n > 1)
    ])


OUTPUT_COLUMNS = tuple(output_schema().names)


def result_row(out: Any) -> dict[str, Any]:
    """Output columns for a finished `RequestOutput` (its first completion)."""
    c = out.outputs[0]
    return {"generated_text": c.text, "generated_token_ids": list(c.token_ids),
            "num_prompt_tokens": len(out.prompt_token_ids), "num_generated_tokens": len(c.token_ids),
            "finish_reason": c.finish_reason, "error": None, **row_extras.result_columns(out)}


def error_row(message: str) -> dict[str, Any]:
    """Output columns for a row that produced nothing: empty outputs, `error` = message."""
    return {"generated_text": "", "generated_token_ids": [], "num_prompt_tokens": 0,
            "num_generated_tokens": 0, "finish_reason": None, "error": message,
            **row_extras.empty_columns()}


def attach_outputs(table: pa.Table, indices: Sequence[int],
                   rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Input rows `indices` of `table`, all columns kept, with the output columns appended."""
    return with_outputs(table, indices, pa.Table.from_pylist(list(rows), schema=output_schema()))


class GenerationRows(RowLifecycle):
    """Rows of one engine in, one request each; finished Futures become generation columns."""

    def __init__(self, driver: Any, builder: RequestBuilder, base_seed: int,
                 on_error: str = "row", request_prefix: str = "row",
                 on_engine_dead: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(driver, on_error, request_prefix, on_engine_dead)
        self.builder = builder
        self.base_seed = base_seed
        # HF fast tokenizers fail with "Already borrowed" when threads share one
        self._build_lock = threading.Lock()
        self._watch = EmptyAnswerWatch.of(driver.engine)

    def _start(self, row: Mapping[str, Any], key: Any, alone: bool) -> tuple[Future, str]:
        """build → seed → submit; `key` seeds unseeded sampling (default: the prompt's ids)."""
        with self._build_lock:
            req = self.builder.build(row)
        params = seeded(req.params, self.base_seed, req.prompt_token_ids if key is None else key)
        rid = self.next_request_id()
        extra = {"alone": True} if alone else {}
        fut = self.driver.submit(req.prompt_token_ids, params, request_id=rid, prompt=req.prompt,
                                 **lora_kwargs(req.lora), **images_kwargs(req.images),
                                 **extra)
        return fut, rid

    def _columns(self, result: Any) -> dict[str, Any]:
        row = result_row(result)
        self._watch.saw(row, self.builder.prompts_as_chat)
        return row

    def _error_columns(self, message: str) -> dict[str, Any]:
        return error_row(message)

    def output_schema(self) -> pa.Schema:
        return output_schema()

    def attach(self, table: pa.Table, indices: Sequence[int],
               rows: Sequence[Mapping[str, Any]]) -> pa.Table:
        return attach_outputs(table, indices, rows)


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
