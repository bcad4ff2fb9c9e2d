"""Spark connector: `batchgen_udf` (a scalar iterator UDF) and `generate_df` (`mapInArrow`).

Compared with `pyspark.ml.functions.predict_batch_udf`, which runs one Arrow batch at a time:
  * rows from many Arrow batches are in flight together (bounded by `max_in_flight`), so the
    engine's batch stays full however small `spark.sql.execution.arrow.maxRecordsPerBatch` is;
  * only configuration is pickled; each Python worker builds its engine once and keeps it for
    later tasks (Spark reuses workers by default: keep `spark.python.worker.reuse=true`);
  * a bad row gets a message in the `error` column instead of failing the task
    (`on_error="raise"` restores fail-fast);
  * with no seed given, each row's seed is derived from the row (its prompt, or its id column in
    `generate_df`), so a retried or speculative task returns the same text.
pyspark and pandas are imported only when these functions are called.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import pyarrow as pa

from batchgen_data.connectors import spark_task
from batchgen_data.connectors.spark_task import TaskSettings
from batchgen_data.connectors.streaming import in_completion_order, in_input_order

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

DEBUG_FIELD = spark_task.DEBUG_FIELD


def _spark_type(schema: pa.Schema) -> "StructType":
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)


def batchgen_udf(model: str | None = None, sampling_params: Any = None, on_error: str = "row",
                 max_in_flight: int | None = None, debug_stats: bool = False,
                 **engine_kwargs: Any) -> Any:
    """A pandas iterator UDF: prompt column in, struct of generation results out.

    The input column may hold prompt strings or chat messages (`array<struct<role, content>>`).
    Results keep input order. `max_in_flight` bounds the rows one task holds (default: twice
    the engine's `max_num_seqs`). `debug_stats=True` adds `engine_max_batch_seqs`: the largest
    engine batch seen by the task so far. Register for SQL with `spark.udf.register(name, udf)`.
    """
    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    settings = TaskSettings.create(model, sampling_params, on_error, max_in_flight,
                                   debug_stats, engine_kwargs)
    return_type = _spark_type(spark_task.output_schema(debug_stats))

    def batchgen_generate(prompts: Iterator[pd.Series]) -> Iterator[pd.DataFrame]:
        yield from _udf_task(settings, prompts)

    # pyspark reads the UDF kind from real (non-string) annotations
    batchgen_generate.__annotations__ = {"prompts": Iterator[pd.Series],
                                         "return": Iterator[pd.DataFrame]}
    return pandas_udf(batchgen_generate, returnType=return_type)


def _udf_task(settings: TaskSettings, prompts: Iterator["pd.Series"]) -> Iterator["pd.DataFrame"]:
    """One task of `batchgen_udf`: submit across Arrow batches, yield in input order."""
    session = spark_task.TaskSession(settings)
    chunks = in_input_order(prompts, lambda s: session.submit(_values(s), _values(s)),
                            settings.max_in_flight)
    for futures in chunks:
        yield session.outputs(futures).to_pandas(types_mapper=_pandas_type)


def _values(series: "pd.Series") -> list[Any]:
    """Python values of a pandas column; chat messages arrive as numpy arrays of dicts."""
    return [v.tolist() if hasattr(v, "tolist") and not isinstance(v, str) else v
            for v in series.tolist()]


def _pandas_type(arrow_type: pa.DataType) -> Any:
    """Keep nullable ints as pandas' Int types so error rows (nulls) do not turn into floats."""
    import pandas as pd

    if pa.types.is_int32(arrow_type):
        return pd.Int32Dtype()
    if pa.types.is_int64(arrow_type):
        return pd.Int64Dtype()
    return None


def generate_df(df: "DataFrame", prompt_col: str = "prompt", id_col: str | None = None,
                model: str | None = None,
                sampling_params: Any = None, on_error: str = "row",
                max_in_flight: int | None = None, debug_stats: bool = False,
                **engine_kwargs: Any) -> "DataFrame":
    """Generate for every row of `df` with `mapInArrow`; rows come back in completion order.

    The result has all input columns plus the output columns. `id_col` names a column that
    identifies rows: it seeds sampling (when no seed is given) and lets callers join results
    back; without it the prompt is the seed key.
    """
    for col in (prompt_col, id_col):
        if col is not None and col not in df.columns:
            raise ValueError(f"column {col!r} not in DataFrame columns {df.columns}")
    settings = TaskSettings.create(model, sampling_params, on_error, max_in_flight,
                                   debug_stats, engine_kwargs)
    out_schema = spark_task.output_schema(debug_stats)
    clash = sorted(set(df.columns) & set(out_schema.names))
    if clash:
        raise ValueError(f"input columns {clash} clash with output columns; rename them first")
    from pyspark.sql.types import StructType

    schema = StructType(df.schema.fields + _spark_type(out_schema).fields)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        yield from _map_task(settings, prompt_col, id_col, batches)

    return df.mapInArrow(run, schema)


def _map_task(settings: TaskSettings, prompt_col: str, id_col: str | None,
              batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """One task of `generate_df`: input columns plus results, as rows finish."""
    session = spark_task.TaskSession(settings)

    def submit(batch: pa.RecordBatch) -> list:
        prompts = batch.column(prompt_col).to_pylist()
        keys = batch.column(id_col).to_pylist() if id_col is not None else prompts
        return session.submit(prompts, keys)

    for done in in_completion_order(batches, submit, settings.max_in_flight):
        inputs = pa.Table.from_batches(
            [batch.slice(i, 1) for batch, i, _ in done]).combine_chunks()
        results = session.outputs([fut for _, _, fut in done])
        yield from pa.Table.from_arrays(
            inputs.columns + results.columns,
            names=inputs.column_names + results.column_names).to_batches()
