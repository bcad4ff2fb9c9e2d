"""Engine statistics of a Spark job, collected per task through a Spark accumulator.

    stats = stats_accumulator(spark)
    out = generate_df(df, stats=stats)        # each task adds what its engine did meanwhile
    out.write.parquet(...)
    record = RunRecord(); record.merge(stats.value)   # then report.html.write_html(record, ...)

A Python worker keeps its engine across tasks (`spark_engine_cache`); `watch` puts one
`EngineSampler` on it, into a record of that worker's own, and at the end of each task the
samples taken since the last one are drained into the accumulator. Spark merges accumulator
updates of successful tasks only, so a retried task's samples are not counted twice.
"""
from __future__ import annotations

import os
import socket
import threading
import weakref
from typing import Any

from batchgen_data.report.record import EngineSampler, RunRecord

_RECORDS: "weakref.WeakKeyDictionary[Any, RunRecord]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _empty() -> dict[str, list[Any]]:
    return {"samples": [], "migrations": [], "finished": []}


def stats_accumulator(spark: Any) -> Any:
    """A driver-side accumulator of `RunRecord` parts (pass it to `generate_df(stats=)`)."""
    from pyspark.accumulators import AccumulatorParam

    class PartParam(AccumulatorParam):
        def zero(self, value: dict[str, list[Any]]) -> dict[str, list[Any]]:
            return _empty()

        def addInPlace(self, a: dict[str, list[Any]], b: dict[str, list[Any]]
                       ) -> dict[str, list[Any]]:
            for key in a:
                a[key] = list(a[key]) + list(b.get(key, ()))
            return a

    return spark.sparkContext.accumulator(_empty(), PartParam())


def watch(driver: Any) -> None:
    """Sample this worker's engine after its steps (once per engine, whatever the tasks)."""
    with _LOCK:
        if driver in _RECORDS:
            return
        record = _RECORDS[driver] = RunRecord()
    actor = f"{socket.gethostname()}:{os.getpid()}"
    driver.step_hooks.append(EngineSampler(record, actor))


def drain(driver: Any) -> dict[str, list[Any]]:
    """The samples taken on this worker's engine since the last drain."""
    with _LOCK:
        record = _RECORDS.get(driver)
    return record.drain() if record is not None else _empty()
