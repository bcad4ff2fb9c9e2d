"""Rows of a pooling task (embed / classify / score) in a connector: row → request → columns.

The pooling counterpart of `rows.RowLifecycle`, with the same methods the connectors call
(`submit`, `outcome`, `abandon`, `attach`) and the same rule for what a row error is
(docs/row-errors.md): a bad row becomes an error row, only a dead engine fails the task.

Input columns: `prompt` (or `text`, or `prompt_token_ids`) for embed and classify; `text_1` and
`text_2` for score; an optional per-row `pooling_params` dict (`dimensions`, `normalize`,
`truncate_prompt_tokens`; `dimensions` only as the job's: the column has one size). Output
columns, after the input ones: `embedding` (fixed_size_list<float32>[dimensions or the
model's hidden size]),
`probs` (list<float32>) or `score` (float64); `num_prompt_tokens`; `error`.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import pyarrow as pa

from batchgen_data.connectors.common import RowError, to_python
from batchgen_data.connectors.rows import check_on_error, error_message, failed_future
from batchgen_data.pooling_params import TASKS, PoolingParams

OUTPUT_OF = {"embed": "embedding", "classify": "probs", "score": "score"}
POOLING_OUTPUT_COLUMNS = ("embedding", "probs", "score", "num_prompt_tokens", "error")


def check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"task_type={task!r}: pooling tasks are {TASKS} (or 'generate')")
    return task


def default_pooling_params(params: PoolingParams | Mapping[str, Any] | None) -> PoolingParams:
    if params is None or isinstance(params, PoolingParams):
        return params or PoolingParams()
    return PoolingParams.from_dict(dict(params))


def _text(row: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        if name in row and to_python(row[name]) is not None:
            return to_python(row[name])
    raise RowError(f"row has no {' / '.join(names)} value")


class PoolingRows:
    """Rows of one pooling engine in, Futures out; finished Futures become column values."""

    programs = None  # the connectors' program path never applies to a pooling task

    def __init__(self, driver: Any, task: str, pooling_params: Any = None,
                 on_error: str = "row", request_prefix: str = "row",
                 on_engine_dead: Any = None) -> None:
        from batchgen_data.engine.driver import EngineDeadError  # executor side only

        self.driver = driver
        self.engine = driver.engine
        self.task = check_task(task)
        self.default_params = default_pooling_params(pooling_params)
        self.on_error = check_on_error(on_error)
        self.on_engine_dead = on_engine_dead
        self._dead = EngineDeadError
        self._prefix = request_prefix
        self._ids = itertools.count()
        self._lock = threading.Lock()  # HF fast tokenizers are not shareable across threads
        self._request_ids: dict[Future, str] = {}
        self._lengths: dict[Future, int] = {}

    def _build(self, row: Mapping[str, Any]) -> tuple[Any, PoolingParams, str]:
        from batchgen_data.engine import pooling_api  # the engine side: imports torch

        extra = to_python(row.get("pooling_params"))
        try:
            params = (PoolingParams.from_dict({**_fields(self.default_params), **extra})
                      if extra else self.default_params)
        except (TypeError, ValueError) as e:
            raise RowError(f"pooling_params: {e}") from None
        if params.dimensions != self.default_params.dimensions:
            raise RowError(f"pooling_params: dimensions={params.dimensions} differs from the "
                           f"job's ({self.default_params.dimensions}); the embedding column has "
                           "one size: set dimensions in the job's pooling_params")
        tok = self.engine.tokenizer
        try:
            with self._lock:
                if self.task == "score":
                    a, b = _text(row, "text_1"), _text(row, "text_2")
                    if not self.engine.cross_encoder:
                        raise RowError("this model cannot score a pair in one pass (score "
                                       "rows need a cross-encoder: a *ForSequenceClassification "
                                       "with num_labels=1)")
                    return pooling_api.encode_pair(tok, a, b), params, "score"
                if "prompt_token_ids" in row and to_python(row["prompt_token_ids"]) is not None:
                    value: Any = {"prompt_token_ids": to_python(row["prompt_token_ids"])}
                else:
                    value = _text(row, "prompt", "text", "input")
                return pooling_api.encode_text(tok, value), params, self.task
        except (TypeError, ValueError) as e:
            raise RowError(str(e)) from None

    def submit(self, row: Mapping[str, Any], key: Any = None) -> Future:
        try:
            (ids, types, text), params, task = self._build(row)
            ids, types = self.engine.prepare(ids, params, task, types)
            rid = f"{self._prefix}-{next(self._ids)}"
            fut: Future = Future()

            def add(engine: Any) -> None:
                try:
                    engine.submit(ids, params, task, request_id=rid, prompt=text,
                                  token_type_ids=types)
                except Exception as e:  # noqa: BLE001 - fails this row only
                    fut.set_exception(e)
                    return
                self.driver.adopt(rid, fut)

            self.driver.call(add)
        except Exception as e:  # noqa: BLE001 - sorted by the rule above
            if isinstance(e, self._dead):
                if self.on_engine_dead is not None:
                    self.on_engine_dead(e)
                raise
            if self.on_error == "raise":
                raise RowError(error_message(e)) from e
            return failed_future(RowError(error_message(e)))
        self._request_ids[fut] = rid
        return fut

    def outcome(self, fut: Future) -> dict[str, Any]:
        self._request_ids.pop(fut, None)
        exc = fut.exception()
        if exc is None:
            out = fut.result()
            value = out.outputs
            row = {"embedding": None, "probs": None, "score": None,
                   "num_prompt_tokens": len(out.prompt_token_ids), "error": None}
            row[OUTPUT_OF[self.task]] = (value.embedding if self.task == "embed" else
                                         value.probs if self.task == "classify" else value.score)
            return row
        if isinstance(exc, self._dead):
            if self.on_engine_dead is not None:
                self.on_engine_dead(exc)
            raise exc
        if self.on_error == "raise":
            raise exc if isinstance(exc, RowError) else RowError(error_message(exc))
        return {"embedding": None, "probs": None, "score": None, "num_prompt_tokens": 0,
                "error": error_message(exc)}

    def abandon(self, futures: Iterable[Future]) -> None:
        rids = [self._request_ids.pop(f) for f in list(futures) if f in self._request_ids]
        if not rids or getattr(self.driver, "dead", None) is not None:
            return

        def abort_all(engine: Any) -> None:
            for rid in rids:
                engine.abort(rid)

        self.driver.call(abort_all)

    @property
    def embedding_size(self) -> int:
        return self.default_params.dimensions or self.engine.hidden_size

    def attach(self, table: pa.Table, indices: Sequence[int],
               rows: Sequence[Mapping[str, Any]]) -> pa.Table:
        return attach_pooling_outputs(table, indices, rows, self.task, self.embedding_size)


def _fields(p: PoolingParams) -> dict[str, Any]:
    return {"dimensions": p.dimensions, "normalize": p.normalize,
            "truncate_prompt_tokens": p.truncate_prompt_tokens, "activation": p.activation}


def pooling_schema(task: str, embedding_size: int | None = None) -> pa.Schema:
    """`embedding_size`: the fixed list size of `embedding` (None: a variable-size list)."""
    col = OUTPUT_OF[check_task(task)]
    if task == "score":
        out_type: pa.DataType = pa.float64()
    elif task == "embed" and embedding_size:
        out_type = pa.list_(pa.float32(), embedding_size)
    else:
        out_type = pa.list_(pa.float32())
    return pa.schema([(col, out_type), ("num_prompt_tokens", pa.int64()),
                      ("error", pa.string())])


def attach_pooling_outputs(table: pa.Table, indices: Sequence[int],
                           rows: Sequence[Mapping[str, Any]], task: str,
                           embedding_size: int | None = None) -> pa.Table:
    """Input rows `indices` of `table`, all columns kept, the task's output columns appended."""
    assert len(indices) == len(rows), (len(indices), len(rows))
    schema = pooling_schema(task, embedding_size)
    kept = table.take(pa.array(indices, type=pa.int64()))
    kept = kept.drop_columns([c for c in schema.names if c in kept.column_names])
    outputs = pa.Table.from_pylist([{k: r[k] for k in schema.names} for r in rows],
                                   schema=schema)
    for fld, column in zip(outputs.schema, outputs.columns):
        kept = kept.append_column(fld, column)
    return kept
