"""Smoke runs of the Spark examples on the shared local session with the tiny model.

The Databricks notebook runs the way a Databricks job would: cell by cell with `spark`
predefined, and (like papermill/job parameters) test values injected after its `# Parameters`
cell.
"""
from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any, Callable

import pytest

pytest.importorskip("pyspark")

pytestmark = pytest.mark.timeout(300)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CELL = "# COMMAND ----------"


def test_spark_batch_example(spark: Any, tiny_model_dir: Callable[..., Path],
                             tmp_path: Path) -> None:
    example = runpy.run_path(str(EXAMPLES / "spark_batch.py"))
    out = example["main"](["--model", str(tiny_model_dir("llama")), "--rows", "12",
                           "--max-tokens", "4", "--output", str(tmp_path / "out")], spark=spark)
    assert out["udf_rows"] == out["generate_df_rows"] == 12 and out["errors"] == 0
    assert 0 <= out["empty"] <= 12  # the tiny random model may well say nothing


def test_databricks_notebook(spark: Any, tiny_model_dir: Callable[..., Path],
                             capsys: pytest.CaptureFixture[str]) -> None:
    source = (EXAMPLES / "databricks_notebook.py").read_text()
    assert source.startswith("# Databricks notebook source")
    cells = source.split(CELL)
    assert any(c.strip().startswith("# Parameters") for c in cells)
    params = f"MODEL = {str(tiny_model_dir('llama'))!r}\nNUM_ROWS = 8\nMAX_TOKENS = 4\n"
    scope: dict[str, Any] = {"spark": spark, "__name__": "__main__"}
    for cell in cells:
        exec(compile(cell, "databricks_notebook.py", "exec"), scope)
        if cell.strip().startswith("# Parameters"):
            exec(params, scope)
    # 8 tickets, two of them empty: the job finishes with two error rows, and says so
    out = capsys.readouterr().out
    assert "rows            8 (6 good, 2 errors)" in out
    # the empty tickets' messages cell is null: the error names the messages field
    assert "error      2  messages must be a non-empty list" in out
    assert "empty " in out and "tokens " in out and "rows/s" in out
