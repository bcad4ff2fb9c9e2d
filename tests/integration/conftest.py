"""Shared fixtures for integration tests: one local Spark session for the whole pytest run
(the local Ray, `ray_local`, is in tests/conftest.py: tests/lab uses it too).

`model` (the tiny random Llama's folder) and `llm` (an `LLM` over it, built with the test
module's `ENGINE` kwargs) are module-scoped: one engine per test module; a module that needs
another model defines its own `model`.

Starting a JVM costs ~10 s, so every Spark test shares this session; tests change only
per-query SQL confs (and restore them), never cluster settings. Ray likewise starts once
(~5 s); Ray tests must leave no actors of their own behind.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

from batchgen_data import LLM


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


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[..., Path]) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def llm(model: str, request: pytest.FixtureRequest) -> LLM:
    return LLM(model, **request.module.ENGINE)
