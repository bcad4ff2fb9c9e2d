"""Spark task retries (docs/guarantees.md): on `local[2,3]` a Python worker is SIGKILLed in the
middle of a `generate_df` task, after half of its partition has gone by; Spark retries the task
and the output holds each row exactly once, identical to an undisturbed run.

It needs its own SparkSession (a master that allows task failures), so it runs in a child
process; the shared test session stays untouched.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

pytest.importorskip("pyspark")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

JOB = r"""
import json, os, signal, sys
from pyspark import TaskContext
from pyspark.sql import SparkSession
from batchgen_data.connectors.spark import generate_df

model, flag = sys.argv[1], sys.argv[2]
spark = (SparkSession.builder.master("local[2,3]").appName("batchgen-retry")
         .config("spark.ui.enabled", "false").config("spark.python.worker.reuse", "true")
         .config("spark.sql.execution.arrow.maxRecordsPerBatch", "4").getOrCreate())
spark.sparkContext.setLogLevel("OFF")
rows = [(i, f"Row {i}: the quick brown fox " + "jumps " * (i % 7)) for i in range(32)]
df = spark.createDataFrame(rows, "id long, prompt string").repartition(2, "id")
params = {"temperature": 0.8, "max_tokens": 12}  # unseeded: each row is seeded from its id

def killer(batches):
    # the first attempt of partition 0 dies once half of its rows have gone downstream
    ctx, sent = TaskContext.get(), 0
    for batch in batches:
        if ctx.partitionId() == 0 and ctx.attemptNumber() == 0 and sent >= 8:
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        sent += batch.num_rows
        yield batch

def run(frame):
    out = generate_df(frame, id_col="id", model=model, sampling_params=params,
                      max_model_len=64, max_num_seqs=16)
    return sorted((r.id, r.generated_text, list(r.generated_token_ids), r.error)
                  for r in out.collect())

calm = run(df)
killed = run(df.mapInArrow(killer, df.schema))
print(json.dumps({"calm": calm, "killed": killed, "died": os.path.exists(flag)}))
spark.stop()
"""


def test_a_killed_python_worker_repeats_and_loses_no_row(tiny_model_dir: Callable[..., Path],
                                                         tmp_path: Path) -> None:
    model = str(tiny_model_dir("llama"))
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable,  # workers: this venv
           "PYSPARK_DRIVER_PYTHON": sys.executable}
    proc = subprocess.run([sys.executable, "-c", JOB, model, str(tmp_path / "died")],
                          capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["died"]  # a worker was killed mid-task and the task was retried
    ids = [r[0] for r in out["killed"]]
    assert ids == list(range(32))  # each row exactly once
    assert out["killed"] == out["calm"]  # the same text and tokens as the undisturbed run
    assert all(r[3] is None for r in out["killed"])
