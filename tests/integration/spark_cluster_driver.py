"""The Spark driver of tests/integration/test_spark_cluster.py, run as its own process (one JVM
holds one SparkContext, and the test session already has its `local[2]` one).

    python spark_cluster_driver.py CONFIG_JSON

builds a SparkSession on the standalone master named in the config, waits for its executors,
prints `READY`, then answers one request per stdin line (`{"job": NAME, "kwargs": {...}}`) with
one `RESULT <json>` line on stdout (`{"ok": true, "value": ...}` or `{"ok": false, "error":
...}`). The jobs are the functions in `JOBS`; functions defined here are `__main__`'s, so
pyspark pickles them by value and the executors, which have only the wheel, never import this
file. It exits on EOF.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Iterator

_RESULT = "RESULT "


def session(config: dict[str, Any]) -> Any:
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(config["master"]).appName("batchgen-cluster-tests")
    for key, value in config["conf"].items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    deadline = time.monotonic() + config.get("executor_wait_s", 120)
    while executor_count(spark) < config["executors"]:  # they start once the app registers
        if time.monotonic() > deadline:
            raise TimeoutError(f"{executor_count(spark)} of {config['executors']} executors "
                               "registered")
        time.sleep(0.2)
    return spark


def executor_count(spark: Any) -> int:
    return spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1  # less the driver


def prompt_df(spark: Any, prompts: list[str]) -> Any:
    """`id long, prompt string` in two partitions, made in the JVM (`spark.range` and a literal
    array): no Python worker for the input, and no shuffle, so a retried task needs nothing
    from an executor that died."""
    from pyspark.sql import functions as F

    texts = F.array(*[F.lit(p) for p in prompts])
    return spark.range(0, len(prompts), 1, 2).select(
        "id", F.element_at(texts, F.col("id").cast("int") + 1).alias("prompt"))


def _rows(out: Any, cols: tuple[str, ...]) -> list[list[Any]]:
    rows = [[r[c] if c != "generated_token_ids" else list(r[c]) for c in cols]
            for r in out.collect()]
    return sorted(rows, key=lambda r: r[0])


COLUMNS = ("id", "generated_token_ids", "generated_text", "error")


def job_probe(spark: Any, root: str, partitions: int = 8) -> list[dict[str, Any]]:
    """Where each executor's Python worker imports batchgen_data from."""

    def probe(batches: Iterator[Any]) -> Iterator[Any]:
        import batchgen_data
        import batchgen_data.connectors.spark  # noqa: F401
        import batchgen_data.engine.engine  # noqa: F401
        import batchgen_data.kernels.cpu.build  # noqa: F401
        from pyspark import TaskContext

        def checkout(p: str) -> bool:  # the checkout or a folder of it (not the venv in it)
            p = os.path.abspath(p or os.getcwd())
            return p == root or (p.startswith(root + os.sep) and "site-packages" not in p)

        mods = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())
                if n == "batchgen_data" or n.startswith("batchgen_data.")}
        import pyarrow as pa

        for _ in batches:
            pass
        seen = {"file": batchgen_data.__file__, "cwd": os.getcwd(), "pid": os.getpid(),
                "executable": sys.executable,
                "checkout_on_path": [p for p in sys.path if checkout(p)],
                "module_files": sorted({os.path.dirname(f) for f in mods.values() if f}),
                "editable_hooks": [repr(f) for f in sys.meta_path if "editable" in repr(f)],
                "partition": TaskContext.get().partitionId()}
        yield pa.RecordBatch.from_pylist([{"probe": json.dumps(seen)}])

    # a SQL Python function (mapInArrow), as the connector's are: Spark pools the Python
    # workers of SQL functions apart from those of RDD functions, so this warms the ones the
    # later jobs get
    df = spark.range(0, partitions, 1, partitions).mapInArrow(probe, "probe string")
    return [json.loads(r.probe) for r in df.collect()]


def job_udf(spark: Any, model: str, prompts: list[str], params: dict[str, Any],
            engine: dict[str, Any]) -> list[list[Any]]:
    from batchgen_data.connectors.spark import batchgen_udf

    gen = batchgen_udf(model, params, apply_chat_template=False, **engine)
    out = prompt_df(spark, prompts).select("id", gen("prompt").alias("o")).select("id", "o.*")
    return _rows(out, COLUMNS)


def job_generate_df(spark: Any, model: str, prompts: list[str], params: dict[str, Any],
                    engine: dict[str, Any]) -> list[list[Any]]:
    from batchgen_data.connectors.spark import generate_df

    out = generate_df(prompt_df(spark, prompts), id_col="id", model=model,
                      sampling_params=params, apply_chat_template=False, **engine)
    return _rows(out, COLUMNS)


def job_killed_executor(spark: Any, model: str, prompts: list[str], params: dict[str, Any],
                        engine: dict[str, Any], flag: str, after_rows: int) -> dict[str, Any]:
    """`generate_df` whose output passes a gate that, once in the whole job (the `flag` file is
    created exclusively), writes its worker's pid to `flag` once `after_rows` generated rows of
    its partition have streamed through, and then waits to be killed: the test kills that
    executor from outside, with rows of the task already handed downstream."""
    from batchgen_data.connectors.spark import generate_df

    def gate(batches: Iterator[Any]) -> Iterator[Any]:
        sent = 0
        for batch in batches:
            if sent >= after_rows:
                try:
                    fd = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    pass
                else:  # the first task over the line: report, then hang until killed
                    os.write(fd, str(os.getpid()).encode())
                    os.close(fd)
                    time.sleep(300)
            sent += batch.num_rows
            yield batch

    sc = spark.sparkContext
    sc.setJobGroup("killed-executor", "generate_df with an executor killed")
    # the gate sees generate_df's rows 4 at a time, as they stream out
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "4")
    try:
        start = time.monotonic()
        out = generate_df(prompt_df(spark, prompts), id_col="id", model=model,
                          sampling_params=params, apply_chat_template=False, **engine)
        rows = _rows(out.mapInArrow(gate, out.schema), COLUMNS)
        wall = time.monotonic() - start
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    tracker = sc.statusTracker()
    stages = [tracker.getStageInfo(s) for j in tracker.getJobIdsForGroup("killed-executor")
              for s in (tracker.getJobInfo(j).stageIds if tracker.getJobInfo(j) else [])]
    return {"rows": rows, "done_at": time.time(), "wall_s": wall,
            "failed_tasks": sum(s.numFailedTasks for s in stages if s),
            "stage_attempts": max((s.currentAttemptId for s in stages if s), default=0) + 1}


def job_notebook(spark: Any, path: str, params: str) -> str:
    """The Databricks notebook cell by cell with `spark` predefined, `params` run after its
    `# Parameters` cell (as job parameters are); returns what it printed."""
    cells = open(path).read().split("# COMMAND ----------")
    scope: dict[str, Any] = {"spark": spark, "__name__": "__main__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for cell in cells:
            exec(compile(cell, os.path.basename(path), "exec"), scope)
            if cell.strip().startswith("# Parameters"):
                exec(params, scope)
    return out.getvalue()


JOBS: dict[str, Callable[..., Any]] = {
    "probe": job_probe, "udf": job_udf, "generate_df": job_generate_df,
    "killed_executor": job_killed_executor, "notebook": job_notebook}


def main() -> None:
    config = json.loads(sys.argv[1])
    spark = session(config)
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            value = JOBS[request["job"]](spark, **request.get("kwargs", {}))
            answer = {"ok": True, "value": value}
        except Exception as err:  # the test shows it; the driver keeps serving
            answer = {"ok": False, "error": f"{type(err).__name__}: {err}"[:4000],
                      "traceback": traceback.format_exc()[-8000:]}
        print(_RESULT + json.dumps(answer), flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
