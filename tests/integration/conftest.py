"""Shared fixtures for integration tests: one local Spark session and one local Ray for the
whole pytest run.

Starting a JVM costs ~10 s, so every Spark test shares this session; tests change only
per-query SQL confs (and restore them), never cluster settings. Ray likewise starts once
(~5 s); Ray tests must leave no actors of their own behind.
"""
from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator["pyspark.sql.SparkSession"]:  # noqa: F821
    pytest.importorskip("pyspark")
    pytest.importorskip("pandas")
    from pyspark.sql import SparkSession

    # Executors must run this interpreter (it has torch and batchgen_data installed).
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2]")
        .appName("batchgen-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.python.worker.reuse", "true")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """A local 2-CPU Ray with Ray Data's progress output off."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False, _temp_dir="/tmp/ray")
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    yield
    ray.shutdown()
