"""Classify product reviews on Spark with batchgen_data.

Two ways to run the same job:
  * `batchgen_udf` — a column expression, usable in select/withColumn and in SQL;
  * `generate_df`  — `mapInArrow`, rows come back as they finish, keyed by an id column.

    python examples/spark_batch.py                    # local[2], the embedded default model
    python examples/spark_batch.py --rows 1000 --model /path/to/hf_model_dir --output out/

On a cluster, submit it with spark-submit (drop --master) and keep `spark.python.worker.reuse`
on (Spark's default) so each Python worker loads the model once for all its tasks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from batchgen_data.connectors.spark import batchgen_udf, generate_df
from batchgen_data.report import summarize

INSTRUCTION = ("Classify the sentiment of this review as positive, negative or mixed. "
               "Answer with one word.\n\nReview: ")
REVIEWS = [
    "The battery died after two days and support never answered.",
    "Great sound, light, and the case feels solid. Would buy again.",
    "Fast delivery, but the screen scratches far too easily.",
    "Does exactly what it says. The app is clunky though.",
]


def reviews(spark: SparkSession, rows: int) -> DataFrame:
    """A small synthetic review table; a real job would read Parquet or a Delta table here."""
    data = [(i, REVIEWS[i % len(REVIEWS)]) for i in range(rows)]
    return spark.createDataFrame(data, "id long, review string")


def with_messages(df: DataFrame) -> DataFrame:
    """Chat messages as an `array<struct<role, content>>` column, the way the model expects."""
    turn = F.struct(F.lit("user").alias("role"),
                    F.concat(F.lit(INSTRUCTION), F.col("review")).alias("content"))
    return df.withColumn("messages", F.array(turn))


def run(spark: SparkSession, model: str | None, rows: int, max_tokens: int,
        output: str | None = None) -> dict[str, Any]:
    params = {"temperature": 0.0, "max_tokens": max_tokens}
    df = with_messages(reviews(spark, rows)).repartition(2)

    classify = batchgen_udf(model, params)
    t0 = time.perf_counter()
    labelled = (df.withColumn("result", classify("messages"))
                  .select("id", "review", "result.*"))  # the struct's fields as columns
    udf_rows = [row.asDict() for row in labelled.collect()]
    udf_s = time.perf_counter() - t0
    report = summarize(udf_rows, wall_s=udf_s)

    t0 = time.perf_counter()
    streamed = generate_df(df, prompt_col="messages", id_col="id", model=model,
                           sampling_params=params)
    if output:
        streamed.drop("messages").write.mode("overwrite").parquet(output)
        df_rows = spark.read.parquet(output).count()
    else:
        df_rows = streamed.count()
    df_s = time.perf_counter() - t0

    for row in sorted(udf_rows, key=lambda r: r["id"])[:4]:
        print(f"{row['id']:>4}  {row['review'][:48]:<48}  -> {row['generated_text']!r}")
    print(f"batchgen_udf:\n{report.format()}")
    summary = {"rows": rows, "udf_rows": len(udf_rows), "generate_df_rows": df_rows,
               "errors": report.error_rows, "empty": report.empty,
               "udf_rows_per_s": report.to_dict()["rows_per_s"],
               "generate_df_rows_per_s": round(df_rows / df_s, 2)}
    print(json.dumps(summary))
    return summary


def main(argv: list[str] | None = None, spark: SparkSession | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: embedded SmolLM2-135M)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--output", default=None, help="write generate_df results here as Parquet")
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args(argv)
    own = spark is None
    if own:
        # local runs: executors must use this interpreter (it has batchgen_data installed)
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        spark = (SparkSession.builder.master(args.master).appName("batchgen-spark-batch")
                 .config("spark.python.worker.reuse", "true")
                 .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    try:
        return run(spark, args.model, args.rows, args.max_tokens, args.output)
    finally:
        if own:
            spark.stop()


if __name__ == "__main__":
    main()
