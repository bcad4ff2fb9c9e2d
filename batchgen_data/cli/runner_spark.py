"""`--runner spark`: `generate_df` (mapInArrow) over a DataFrame of the work items.

The active SparkSession is used when there is one (spark-submit, a notebook); otherwise a
local one with `--actors` cores, one engine per Python worker. `generate_df` reads one input
column, and a Spark column has one type, so prompts, chat messages and token ids run as up to
three DataFrames, one after the other; rows of each stream back through `toLocalIterator` as
Spark finishes its partitions; each task adds its engine's samples to an accumulator, the
report's timelines (`connectors/spark/metrics.py`). Work items become rows as on Ray
(`dataset_rows.py`), and `n > 1` samples and logprobs come back in the connectors' list columns.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any

from batchgen_data.cli.dataset_rows import KEY, dataset_row, load_tokenizer, top_count
from batchgen_data.cli.inputs import WorkItem
from batchgen_data.cli.outcome import Emit, outcome_from_row
from batchgen_data.report.record import RunRecord

_TYPES = {"prompt": "string", "messages": "array<struct<role:string,content:string>>",
          "prompt_token_ids": "array<int>"}


class SparkRunner:
    """Runs the work items' rows with `generate_df`, one DataFrame per input column kind."""

    def __init__(self, model: str | None, engine_kwargs: dict[str, Any],
                 default_params: dict[str, Any], record: RunRecord | None = None,
                 actors: int = 1) -> None:
        self.record = record if record is not None else RunRecord()
        self.model = model
        self.engine_kwargs = engine_kwargs
        self.default_params = default_params
        self.actors = actors
        self.tokenizer = load_tokenizer(model, engine_kwargs)
        self.submitted = 0

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _session(self) -> Any:
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            return active
        # a local run: the workers must use this interpreter, which has the engine installed
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        return (SparkSession.builder.master(f"local[{self.actors}]")
                .appName("batchgen-data").config("spark.ui.enabled", "false")
                .config("spark.python.worker.reuse", "true").getOrCreate())

    def run(self, items: Iterable[WorkItem], emit: Emit) -> None:
        from batchgen_data.connectors.spark import generate_df

        by_key: dict[str, WorkItem] = {}
        groups: dict[str, list[tuple[Any, ...]]] = {}
        for item in items:
            row = dataset_row(item, self.tokenizer, emit, "spark")
            if row is None:
                continue
            by_key[item.key] = item
            column = next((c for c in ("prompt_token_ids", "messages", "prompt")
                           if row.get(c) is not None), "prompt")
            groups.setdefault(column, []).append((row[KEY], row[column], row["sampling_params"]))
        if not groups:
            return
        from batchgen_data.connectors.spark.metrics import stats_accumulator

        spark = self._session()
        stats = stats_accumulator(spark)  # each task adds its engine's samples
        for column, rows in groups.items():
            schema = f"{KEY} string, {column} {_TYPES[column]}, sampling_params string"
            df = spark.createDataFrame(rows, schema).repartition(self.actors)
            out = generate_df(df, prompt_col=column, id_col=KEY, stats=stats,
                              sampling_params=self.default_params, **self.engine_kwargs)
            self.submitted += len(rows)
            for r in out.toLocalIterator():
                item = by_key[r[KEY]]
                emit(outcome_from_row(item, r.asDict(recursive=True), actor="spark",
                                      num_top=top_count(item)))
        self.record.merge(stats.value)
