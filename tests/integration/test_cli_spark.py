"""`batchgen-data run --runner spark` on a small table: a table out, same text as local, and
engine timelines collected per Spark task."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchgen_data.cli.main import Job, build_parser

pytestmark = pytest.mark.slow


def _job(*argv: str) -> Job:
    job = Job(build_parser().parse_args(["run", *argv, "--max-tokens", "8"]))
    assert job.run() == 0
    return job


def test_spark_runner_writes_the_table_local_writes(tmp_path: Path, spark: object) -> None:
    import pyarrow.parquet as pq

    src = tmp_path / "in.jsonl"
    greedy = json.dumps({"temperature": 0})  # unseeded sampling is keyed per runner
    src.write_text("".join(json.dumps({**r, "sampling_params": greedy}) + "\n" for r in [
        {"id": 1, "prompt": "What is the capital of France?"},
        {"id": 2, "prompt": "Name a colour."},
        {"id": 3, "prompt": ""}]))
    _job(str(src), "-o", str(tmp_path / "spark.parquet"), "--runner", "spark", "--report",
         str(tmp_path / "r.html"))
    _job(str(src), "-o", str(tmp_path / "local.parquet"), "--runner", "local")
    got = pq.read_table(tmp_path / "spark.parquet").to_pylist()
    want = pq.read_table(tmp_path / "local.parquet").to_pylist()
    assert [r["id"] for r in got] == [1, 2, 3]  # input order, whatever order rows finished in
    cols = ("generated_text", "num_prompt_tokens", "finish_reason", "error")
    assert [{c: r[c] for c in cols} for r in got] == [{c: r[c] for c in cols} for r in want]
    assert got[2]["error"].startswith("prompt is empty") and got[0]["generated_text"]
    # per-task engine samples reached the driver through the accumulator: a timeline
    assert "<h3>" in (tmp_path / "r.html").read_text()
