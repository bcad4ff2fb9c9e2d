"""Resume after a crash (docs/guarantees.md): a job whose driver is SIGKILLed halfway, started
again with the same output location, generates exactly the rows the first run did not write.

Each job runs as its own process (`resume_ray_job.py`, `resume_spark_job.py`), with its own
local Ray or Spark, and logs the ids of every batch handed to an engine. The first run is
SIGKILLed as soon as some rows are durably written; the rest of its process group (Ray's or
Spark's own processes) is killed after it, as a lost machine would be. The second run must ask
the engines for exactly the rows not written, each once; the output must then hold every input
row once, with the greedy tokens of an offline run.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq
import pytest

from batchgen_data import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HERE = Path(__file__).resolve().parent
ENGINE = {"max_model_len": 96, "max_num_seqs": 8}
ROWS = 48


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[..., Path]) -> str:
    return str(tiny_model_dir("llama"))


def prompt(i: int) -> str:
    return f"Row {i}: the tide and the {i % 7} winds"  # as both job scripts build it


def run_job(cmd: list[str], log: Path, kill_when: Callable[[], bool] | None = None,
            timeout_s: float = 300.0) -> int | None:
    """Run `cmd` in a new process group; with `kill_when`, SIGKILL the driver as soon as it
    holds, then its whole group. Returns the exit code (None when killed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(HERE), os.environ.get("PYTHONPATH")]))}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if kill_when is not None and kill_when():
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                return None
            time.sleep(0.05)
        if proc.poll() is None:
            pytest.fail(f"{cmd[1]} ran past {timeout_s} s; log: {log.read_text()[-3000:]}")
        return proc.returncode
    finally:
        time.sleep(1.0)  # let in-flight file writes of the dead job land (or not) first
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # Ray's / Spark's processes of that job
        except ProcessLookupError:
            pass


def seen_ids(seen_dir: Path) -> list[int]:
    """Every id the engines of one run were handed, once per time it was handed."""
    return sorted(int(line) for f in seen_dir.glob("*.txt") for line in f.read_text().split())


def parquet_ids(files: list[Path]) -> set[int]:
    return {i for f in files for i in pq.read_table(f, columns=["id"]).column("id").to_pylist()}


def offline(model: str) -> dict[int, list[int]]:
    llm = LLM(model, **ENGINE)
    outs = llm.chat([[{"role": "user", "content": prompt(i)}] for i in range(ROWS)],
                    SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    return {i: list(o.outputs[0].token_ids) for i, o in enumerate(outs)}


def check_resumed(model: str, out: Path, done: set[int], seen_second: list[int]) -> None:
    todo = sorted(set(range(ROWS)) - done)
    assert 0 < len(done) < ROWS, f"the first run was not stopped halfway ({len(done)} written)"
    assert seen_second == todo, (f"second run generated {len(seen_second)} rows, "
                                 f"{len(todo)} were missing; again: "
                                 f"{sorted(set(seen_second) & done)}")
    table = pq.read_table(out).to_pylist()  # '_' and '.' files (Spark's, Ray's) are skipped
    ids = sorted(r["id"] for r in table)
    assert ids == list(range(ROWS)), f"lost {set(range(ROWS)) - set(ids)}, twice " \
                                     f"{sorted(i for i in set(ids) if ids.count(i) > 1)}"
    want = offline(model)
    for r in table:
        assert r["error"] is None, r
        assert list(r["generated_token_ids"]) == want[r["id"]], r["id"]


def test_ray_job_killed_halfway_resumes_without_regenerating(model: str, tmp_path: Path) -> None:
    pytest.importorskip("ray.data.checkpoint")
    out, ckpt = tmp_path / "out", tmp_path / "out.checkpoint"
    seen = [tmp_path / f"seen{k}" for k in range(3)]
    for d in seen:
        d.mkdir()

    def cmd(k: int) -> list[str]:
        return [sys.executable, str(HERE / "resume_ray_job.py"), model, str(out), str(ckpt),
                str(seen[k]), str(ROWS)]

    def committed() -> list[Path]:  # Ray's record of blocks fully written
        return [p for p in ckpt.glob("*.parquet") if not p.name.endswith(".pending.parquet")]

    assert run_job(cmd(0), tmp_path / "run0.log", kill_when=lambda: len(committed()) >= 2) \
        is None, "the first run finished before it could be killed"
    done = parquet_ids(committed())
    assert run_job(cmd(1), tmp_path / "run1.log") == 0, (tmp_path / "run1.log").read_text()[-3000:]
    check_resumed(model, out, done, seen_ids(seen[1]))
    # the record is kept: the finished job run again generates nothing and writes nothing
    rows_before = pq.read_table(out).num_rows
    assert run_job(cmd(2), tmp_path / "run2.log") == 0, (tmp_path / "run2.log").read_text()[-3000:]
    assert seen_ids(seen[2]) == [] and pq.read_table(out).num_rows == rows_before


def test_spark_job_killed_halfway_resumes_without_regenerating(model: str,
                                                                tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    out = tmp_path / "out"
    seen = [tmp_path / f"seen{k}" for k in range(2)]
    for d in seen:
        d.mkdir()

    def cmd(k: int) -> list[str]:
        return [sys.executable, str(HERE / "resume_spark_job.py"), model, str(out),
                str(seen[k]), str(ROWS), "4"]

    def written() -> list[Path]:  # files of committed write jobs (a task's sit in _temporary)
        return sorted(out.glob("*.parquet"))

    assert run_job(cmd(0), tmp_path / "run0.log", kill_when=lambda: bool(written())) is None, \
        "the first run finished before it could be killed"
    done = parquet_ids(written())
    assert run_job(cmd(1), tmp_path / "run1.log") == 0, (tmp_path / "run1.log").read_text()[-3000:]
    check_resumed(model, out, done, seen_ids(seen[1]))
