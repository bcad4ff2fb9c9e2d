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
With `program=` (a `@batchgen_data.program` with a declared schema) each row runs that program
and its output columns replace the generation columns (docs/programs.md); with `task="embed"`,
`"classify"` or `"score"` each row is a pooling request, with `embedding` (array<float>),
`probs` (array<float>) or `score` (double) columns, `num_prompt_tokens` and `error`; score
reads `text_1` and `text_2` (a `struct<text_1, text_2>` column for the UDF). Every kind goes
through the same task (`task.TaskSession` over the kind's `handler.RowHandler`).
pyspark and pandas are imported only when these functions are called.
"""
from __future__ import annotations

import warnings
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Iterator

import pyarrow as pa

from batchgen_data.connectors.cells import to_python
from batchgen_data.connectors.common import UniqueIds
from batchgen_data.connectors.resume import skip_written
from batchgen_data.connectors.row_kinds import value_row
from batchgen_data.connectors.spark import task as spark_task
from batchgen_data.connectors.spark.streaming import in_completion_order, in_input_order
from batchgen_data.connectors.spark.task import TaskSettings

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

DEBUG_FIELD = spark_task.DEBUG_FIELD


def _spark_type(schema: pa.Schema) -> "StructType":
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)


def _check_worker_reuse() -> None:
    """Warn (driver side) when Python workers are not reused: each task would reload the model."""
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is not None and spark.conf.get("spark.python.worker.reuse", "true") == "false":
        warnings.warn("spark.python.worker.reuse=false: each Spark task will load the model "
                      "again; set it to true (Spark's default) for batchgen_data", stacklevel=3)


def batchgen_udf(model: str | None = None, sampling_params: Any = None, on_error: str = "row",
                 max_in_flight: int | None = None, debug_stats: bool = False,
                 apply_chat_template: bool = True, program: Any = None,
                 chat_template: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None,
                 task: str = "generate", pooling_params: Any = None,
                 engine_factory: Any = None, **engine_kwargs: Any) -> Any:
    """A pandas iterator UDF: prompt column in, struct of generation results out.
    `task` "embed" / "classify" / "score": a pooling task instead (its input column holds
    prompts, or `struct<text_1, text_2>` pairs for score).

    The input column may hold prompt strings, chat messages (`array<struct<role, content>>`) or
    token ids. With `apply_chat_template=True` (the default) messages, and prompt strings as one
    user turn, go through the tokenizer's chat template; False sends prompts as written.
    Results keep input order. `max_in_flight` bounds the rows one task holds (default: twice
    the engine's `max_num_seqs`). `debug_stats=True` adds `engine_max_batch_seqs`: the largest
    engine batch seen by the task so far. Register for SQL with `spark.udf.register(name, udf)`.
    `engine_factory`: a picklable `(model, **engine_kwargs) -> engine` the executors build
    their engine with (an engine around parts of one's own, `Engine(config, parts)`: a runner
    of one's own, worker/runner.py); None: batchgen_data's for `task`.
    """
    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    settings = TaskSettings.create(model, sampling_params, on_error, max_in_flight,
                                   debug_stats, engine_kwargs, apply_chat_template, program,
                                   chat_template, chat_template_kwargs, task, pooling_params,
                                   engine_factory=engine_factory)
    _check_worker_reuse()
    return_type = _spark_type(settings.output_schema())

    def batchgen_generate(prompts: Iterator[pd.Series]) -> Iterator[pd.DataFrame]:
        yield from _udf_task(settings, prompts)

    # pyspark reads the UDF kind from real (non-string) annotations
    batchgen_generate.__annotations__ = {"prompts": Iterator[pd.Series],
                                         "return": Iterator[pd.DataFrame]}
    return pandas_udf(batchgen_generate, returnType=return_type)


def _udf_task(settings: TaskSettings, prompts: Iterator["pd.Series"]) -> Iterator["pd.DataFrame"]:
    """One task of `batchgen_udf`: submit across Arrow batches, yield in input order."""
    import pandas as pd

    session = spark_task.TaskSession(settings)
    names = settings.output_schema().names

    def submit(series: pd.Series) -> list[Future]:
        if isinstance(series, pd.DataFrame):  # a struct column: one row dict per struct
            rows = [to_python(r) for r in series.to_dict("records")]
            return session.submit(rows, [None] * len(rows))
        values = [to_python(v) for v in series.tolist()]
        return session.submit([value_row(v) for v in values], values)

    try:
        for futures in in_input_order(prompts, submit, settings.max_in_flight,
                                      session.abandon):
            yield pd.DataFrame.from_records(session.output_rows(futures), columns=names)
    finally:
        session.finish()


def generate_df(df: "DataFrame", prompt_col: str = "prompt", id_col: str | None = None,
                model: str | None = None, sampling_params: Any = None, on_error: str = "row",
                max_in_flight: int | None = None, debug_stats: bool = False,
                apply_chat_template: bool = True, stats: Any = None,
                program: Any = None, chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None,
                resume_from: str | None = None, task: str = "generate",
                pooling_params: Any = None, engine_factory: Any = None,
                **engine_kwargs: Any) -> "DataFrame":
    """Generate for every row of `df` with `mapInArrow`; rows come back in completion order.

    The result has all input columns plus the output columns. `id_col` names a column that
    identifies rows: it seeds sampling (when no seed is given) and lets callers join results
    back; without it the prompt is the seed key. `apply_chat_template` as in `batchgen_udf`.
    `stats`: a `spark_metrics.stats_accumulator(spark)` that each task adds its engine's
    samples to (for `report.html`).
    Per-row columns, when present: `sampling_params`, `structured_outputs`, `response_format`,
    `chat_template_kwargs` (docs/structured-output.md).
    `resume_from`: an output location (Parquet) whose `id_col` values are skipped, i.e. rows
    a crashed run already wrote (`spark_resume.write_generated` writes in resumable parts).
    `task` "embed" / "classify" / "score": a pooling task (score reads `text_1` and `text_2`).
    `engine_factory` as in `batchgen_udf`.
    """
    settings = TaskSettings.create(model, sampling_params, on_error, max_in_flight,
                                   debug_stats, engine_kwargs, apply_chat_template, program,
                                   chat_template, chat_template_kwargs, task, pooling_params,
                                   stats, engine_factory)
    for col in (*settings.rows.input_columns(prompt_col), id_col):
        if col is not None and col not in df.columns:
            raise ValueError(f"column {col!r} not in DataFrame columns {df.columns}")
    if resume_from is not None:
        if id_col is None:
            raise ValueError("resume_from needs id_col: the ids tell written rows apart")
        df = skip_written(df, resume_from, id_col)
    _check_worker_reuse()
    from pyspark.sql.types import StructType

    out_fields = _spark_type(settings.output_schema()).fields
    # like common.attach_outputs: an input column named like an output column is replaced
    kept = [f for f in df.schema.fields if f.name not in {o.name for o in out_fields}]
    schema = StructType(kept + out_fields)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        yield from _map_task(settings, prompt_col, id_col, batches)

    return df.mapInArrow(run, schema)


def _map_task(settings: TaskSettings, prompt_col: str, id_col: str | None,
              batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """One task of `generate_df`: input columns plus results, as rows finish."""
    session = spark_task.TaskSession(settings)
    ids = UniqueIds(id_col) if id_col is not None else None

    def submit(batch: pa.RecordBatch) -> list[Future]:
        pairs = [settings.rows.row_of(r, prompt_col) for r in batch.to_pylist()]
        rows = [row for row, _ in pairs]
        if ids is None:
            return session.submit(rows, [key for _, key in pairs])
        keys = batch.column(id_col).to_pylist()
        problems = [ids.problem(k) for k in keys]
        return [session.reject(p) if p else session.submit([row], [k])[0]
                for row, k, p in zip(rows, keys, problems)]

    try:
        for done in in_completion_order(batches, submit, settings.max_in_flight,
                                        session.abandon):
            # finished rows grouped by the input batch they came from, so columns are taken once
            groups: dict[int, tuple[pa.RecordBatch, list[int], list[Future]]] = {}
            for batch, i, fut in done:
                _, indices, futures = groups.setdefault(id(batch), (batch, [], []))
                indices.append(i)
                futures.append(fut)
            for batch, indices, futures in groups.values():
                table = session.attach(pa.Table.from_batches([batch]), indices,
                                       session.output_rows(futures))
                yield from table.to_batches()
    finally:
        session.finish()
