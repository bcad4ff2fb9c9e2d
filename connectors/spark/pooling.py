"""Spark for the pooling tasks: `batchgen_udf(task=...)` and `generate_df(df, task=...)`
(connectors/spark/__init__.py hands these calls here).

One pooling engine per Python worker (`EngineCache`, as generation keeps one), rows through
`PoolingRows` (the row rules of every connector), many Arrow batches in flight at once. The
output columns: `embedding` (array<float>), `probs` (array<float>) or `score` (double), with
`num_prompt_tokens` and `error`. Embed and classify read the prompt column; score reads
`text_1` and `text_2` (a struct column `struct<text_1, text_2>` for the UDF).
"""
from __future__ import annotations

import itertools
import os
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Iterator

import pyarrow as pa

from batchgen_data.connectors import common
from batchgen_data.connectors.pooling_rows import (PoolingRows, attach_pooling_outputs,
                                                   check_task, default_pooling_params,
                                                   pooling_schema)
from batchgen_data.connectors.spark.engine_cache import EngineCache, EngineSpec
from batchgen_data.connectors.spark.streaming import in_completion_order, in_input_order

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame


def build_pooling_driver(spec: EngineSpec) -> Any:
    from batchgen_data.engine.driver import EngineDriver
    from batchgen_data.engine.pooling import PoolingEngine

    return EngineDriver(PoolingEngine.from_kwargs(spec.model, **spec.kwargs))  # type: ignore[arg-type]


_ENGINES = EngineCache(build_pooling_driver)
_task_ids = itertools.count()


def _session(spec: EngineSpec, task: str, params: Any, on_error: str) -> PoolingRows:
    driver = _ENGINES.get(spec)
    return PoolingRows(driver, task, params, on_error,
                       request_prefix=f"spark-{os.getpid()}-{next(_task_ids)}",
                       on_engine_dead=lambda _: _ENGINES.discard(driver))


def _spark_schema(task: str) -> Any:
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(pooling_schema(task))


def _settings(model: str | None, task: str, pooling_params: Any, on_error: str,
              max_in_flight: int | None, engine_kwargs: dict[str, Any]) -> tuple[EngineSpec, int]:
    check_task(task)
    default_pooling_params(pooling_params)  # a typo fails on the driver
    spec = EngineSpec.create(model, engine_kwargs)
    return spec, max_in_flight or 2 * spec.max_num_seqs


def pooling_udf(model: str | None, task: str, pooling_params: Any = None,
                on_error: str = "row", max_in_flight: int | None = None,
                **engine_kwargs: Any) -> Any:
    """A pandas iterator UDF: a prompt column (a `struct<text_1, text_2>` for score) in, a
    struct of the task's output columns out, in input order."""
    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    spec, window = _settings(model, task, pooling_params, on_error, max_in_flight,
                             engine_kwargs)
    names = pooling_schema(task).names

    def batchgen_pool(values: Iterator[pd.Series]) -> Iterator[pd.DataFrame]:
        rows_of = _session(spec, task, pooling_params, on_error)

        def submit(series: pd.Series) -> list[Future]:
            if isinstance(series, pd.DataFrame):
                rows = [common.to_python(r) for r in series.to_dict("records")]
            else:
                rows = [{"prompt": common.to_python(v)} for v in series.tolist()]
            return [rows_of.submit(r) for r in rows]

        for futures in in_input_order(values, submit, window, rows_of.abandon):
            yield pd.DataFrame.from_records([rows_of.outcome(f) for f in futures],
                                            columns=names)

    batchgen_pool.__annotations__ = {"values": Iterator[pd.Series],
                                     "return": Iterator[pd.DataFrame]}
    return pandas_udf(batchgen_pool, returnType=_spark_schema(task))


def pooling_df(df: "DataFrame", task: str, prompt_col: str = "prompt",
               model: str | None = None, pooling_params: Any = None, on_error: str = "row",
               max_in_flight: int | None = None, **engine_kwargs: Any) -> "DataFrame":
    """`generate_df` for a pooling task: all input columns plus the task's, completion order."""
    from pyspark.sql.types import StructType

    needed = ("text_1", "text_2") if task == "score" else (prompt_col,)
    for col in needed:
        if col not in df.columns:
            raise ValueError(f"column {col!r} not in DataFrame columns {df.columns}")
    spec, window = _settings(model, task, pooling_params, on_error, max_in_flight,
                             engine_kwargs)
    out_fields = _spark_schema(task).fields
    kept = [f for f in df.schema.fields if f.name not in {o.name for o in out_fields}]
    schema = StructType(kept + out_fields)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        rows_of = _session(spec, task, pooling_params, on_error)

        def submit(batch: pa.RecordBatch) -> list[Future]:
            rows = batch.to_pylist()
            if task != "score" and prompt_col != "prompt":
                rows = [{**r, "prompt": r[prompt_col]} for r in rows]
            return [rows_of.submit(r) for r in rows]

        for done in in_completion_order(batches, submit, window, rows_of.abandon):
            groups: dict[int, tuple[pa.RecordBatch, list[int], list[Future]]] = {}
            for batch, i, fut in done:
                _, indices, futures = groups.setdefault(id(batch), (batch, [], []))
                indices.append(i)
                futures.append(fut)
            for batch, indices, futures in groups.values():
                table = attach_pooling_outputs(pa.Table.from_batches([batch]), indices,
                                               [rows_of.outcome(f) for f in futures], task)
                yield from table.to_batches()

    return df.mapInArrow(run, schema)
