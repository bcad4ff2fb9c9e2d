"""A Spark job that `test_resume_spark.py` runs in its own process (and SIGKILLs).

    python resume_spark_job.py MODEL OUT_DIR SEEN_DIR ROWS PARTS

`write_generated` over ROWS prompts into OUT_DIR (Parquet, PARTS write jobs). Every input
batch that reaches an engine task is logged, one id a line, under SEEN_DIR: `generate_df`'s
task function is wrapped here, in the driver, and Spark ships the wrapper to the workers with
the job, so the test counts exactly what the engines were asked to generate.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
from pyspark.sql import SparkSession

import batchgen_data.connectors.spark as spark_connector
from batchgen_data.connectors.spark.resume import write_generated

ENGINE = {"max_model_len": 96, "max_num_seqs": 8}
SEEN_DIR = sys.argv[3] if len(sys.argv) > 3 else ""
_real_map_task = spark_connector._map_task


def logging_map_task(settings: Any, prompt_col: str, id_col: str | None,
                     batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """`_map_task`, after writing the ids of each batch it is handed to SEEN_DIR/<pid>.txt."""
    def logged() -> Iterator[pa.RecordBatch]:
        log = Path(SEEN_DIR) / f"{os.getpid()}.txt"
        for batch in batches:
            with log.open("a") as f:
                f.write("".join(f"{i}\n" for i in batch.column(id_col).to_pylist()))
            yield batch

    yield from _real_map_task(settings, prompt_col, id_col, logged())


def main(model: str, out: str, rows: int, parts: int) -> None:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master("local[2]").appName("resume-test")
             .config("spark.ui.enabled", "false").config("spark.python.worker.reuse", "true")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark_connector._map_task = logging_map_task  # shipped by value inside generate_df's task
    df = spark.createDataFrame(
        [(i, f"Row {i}: the tide and the {i % 7} winds") for i in range(rows)],
        "id long, prompt string").repartition(2)
    write_generated(df, out, "id", parts=parts, model=model,
                    sampling_params={"max_tokens": 8, "temperature": 0.0}, **ENGINE)
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[4]), int(sys.argv[5]))
