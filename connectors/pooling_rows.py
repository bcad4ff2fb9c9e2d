"""Pooling rows (embed / classify / score): a row → one pooling request → the task's columns
(a `handler.RowLifecycle`: the same rule for what a row error is as every kind,
docs/row-errors.md).

Input columns: `prompt` (or `text`, or `prompt_token_ids`) for embed and classify; `text_1` and
`text_2` for score; an optional per-row `pooling_params` dict (`dimensions`, `normalize`,
`truncate_prompt_tokens`; `dimensions` only as the job's: the column has one size). Output
columns, after the input ones: `embedding` (fixed_size_list<float32>[dimensions or the
model's hidden size]),
`probs` (list<float32>) or `score` (float64); `num_prompt_tokens`; `error`.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import pyarrow as pa

from batchgen_data.connectors.cells import to_python, with_outputs
from batchgen_data.connectors.handler import RowError, RowLifecycle
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


class PoolingRows(RowLifecycle):
    """Rows of one pooling engine in, one request each; finished Futures become the task's
    column (`embedding`, `probs` or `score`)."""

    def __init__(self, driver: Any, task: str, pooling_params: Any = None,
                 on_error: str = "row", request_prefix: str = "row",
                 on_engine_dead: Callable[[BaseException], None] | None = None,
                 fixed_size: bool = True) -> None:
        """`fixed_size`: `embedding` of the engine's size (False: a variable-size list, for a
        connector that declared its columns before the engine existed)."""
        super().__init__(driver, on_error, request_prefix, on_engine_dead)
        self.engine = driver.engine
        self.fixed_size = fixed_size
        self.task = check_task(task)
        self.default_params = default_pooling_params(pooling_params)
        self._lock = threading.Lock()  # HF fast tokenizers are not shareable across threads

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

    def _start(self, row: Mapping[str, Any], key: Any, alone: bool) -> tuple[Future, str]:
        """The request goes in through `driver.call` (a pooling engine's own `submit`); `key`
        and `alone` do not apply: pooling draws nothing and runs one pass per request."""
        (ids, types, text), params, task = self._build(row)
        ids, types = self.engine.prepare(ids, params, task, types)
        rid = self.next_request_id()
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
        return fut, rid

    def _columns(self, result: Any) -> dict[str, Any]:
        value = result.outputs
        row = self._error_columns("")
        row.update(error=None, num_prompt_tokens=len(result.prompt_token_ids))
        row[OUTPUT_OF[self.task]] = (value.embedding if self.task == "embed" else
                                     value.probs if self.task == "classify" else value.score)
        return row

    def _error_columns(self, message: str) -> dict[str, Any]:
        return {"embedding": None, "probs": None, "score": None, "num_prompt_tokens": 0,
                "error": message}

    def output_schema(self) -> pa.Schema:
        return pooling_schema(self.task, self.embedding_size)

    @property
    def embedding_size(self) -> int | None:
        if not self.fixed_size:
            return None
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
    schema = pooling_schema(task, embedding_size)
    return with_outputs(table, indices, pa.Table.from_pylist(
        [{k: r[k] for k in schema.names} for r in rows], schema=schema))
