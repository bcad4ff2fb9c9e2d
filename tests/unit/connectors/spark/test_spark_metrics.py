"""Per-task engine samples on Spark: one sampler per worker engine, drained once per task."""
from __future__ import annotations

from batchgen_data.connectors.spark import metrics as spark_metrics


class _Load:
    waiting, running, held = 0, 2, 0


class _Engine:
    stats = type("S", (), {"generated_tokens": 3})()

    def num_unfinished(self) -> int:
        return 2

    def load(self) -> _Load:
        return _Load()


class _Driver:
    def __init__(self) -> None:
        self.engine = _Engine()
        self.step_hooks: list = []


def test_watch_once_per_engine_and_drain_per_task() -> None:
    driver = _Driver()
    spark_metrics.watch(driver)
    spark_metrics.watch(driver)  # a second task on the same worker engine
    assert len(driver.step_hooks) == 1
    driver.step_hooks[0](driver.engine)
    first = spark_metrics.drain(driver)
    assert len(first["samples"]) == 1 and first["samples"][0][3] == 2  # running
    assert spark_metrics.drain(driver)["samples"] == []  # the next task starts empty
    assert spark_metrics.drain(_Driver()) == {"samples": [], "migrations": [], "finished": []}
