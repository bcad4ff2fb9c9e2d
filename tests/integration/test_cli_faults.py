"""Fault injection through the command (issue 57), local runner, tiny random Llama.

A poisoned line among many good ones: every good line comes out once, with the text and token
count of a run without the poison (the oracle: the same lines run alone), and the poisoned
line is an error naming its field. A fake at the runner seam (`cli.main.make_runner`) makes a
step raise: for one row (that row's error, the engine goes on) or for the engine (it dies: the
lines it took with it are `engine_failed`, the run exits 1, and `--resume` answers them). Two
runs started on one output: the second fails at once naming the first.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchgen_data.cli.main import main

cli_main = sys.modules["batchgen_data.cli.main"]  # the package's `main` names the function

pytestmark = pytest.mark.timeout(300)
ENGINE = '{"max_num_seqs": 4, "max_model_len": 128}'
GOOD = 24


def _line(i: int, **body: Any) -> dict[str, Any]:
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"Tell me fact {i}."}],
                     "max_tokens": 12, "temperature": 0, **body}}


# poisoned Batch lines: (body fields, the field its error must name)
POISON = {"n": ({"n": "2"}, "n"),
          "seed": ({"seed": 2**64, "temperature": 0.8}, "seed"),
          "penalty": ({"repetition_penalty": 1e-300, "temperature": 0.8}, "repetition_penalty"),
          "nan": ({"temperature": math.nan}, "temperature"),
          "top": ({"logprobs": True, "top_logprobs": 100000}, "top_logprobs")}


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))  # NaN as Python writes it
    return path


def _run(src: Path, out: Path, model: str, *extra: str) -> int:
    return main(["run", str(src), "-o", str(out), "--model", model, "--runner", "local",
                 "--engine-kwargs", ENGINE, *extra])


def _by_id(path: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for text in path.read_text().splitlines():
        line = json.loads(text)
        out.setdefault(line["custom_id"], []).append(line)
    return out


def _answer(line: dict[str, Any]) -> tuple[str, int]:
    body = line["response"]["body"]
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


@pytest.fixture(scope="module")
def clean(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, int]]:
    """The good lines run alone: each one's text and completion tokens."""
    tmp = tmp_path_factory.mktemp("clean")
    out = tmp / "out.jsonl"
    assert _run(_write(tmp / "in.jsonl", [_line(i) for i in range(GOOD)]), out, model) == 0
    got = _by_id(out)
    assert all(len(v) == 1 and v[0]["error"] is None for v in got.values())
    return {k: _answer(v[0]) for k, v in got.items()}


def _check_good(got: dict[str, list[dict[str, Any]]], clean: dict[str, tuple[str, int]]) -> None:
    for key, want in clean.items():
        assert len(got[key]) == 1, key  # once
        assert got[key][0]["error"] is None, got[key]
        assert _answer(got[key][0]) == want, key


def test_poisoned_lines_are_their_own_errors(model: str, tmp_path: Path,
                                             clean: dict[str, tuple[str, int]]) -> None:
    lines = [_line(i) for i in range(GOOD)]
    for k, (body, _) in POISON.items():
        lines.insert(len(lines) // 2, {**_line(0, **body), "custom_id": f"poison-{k}"})
    out = tmp_path / "out.jsonl"
    assert _run(_write(tmp_path / "in.jsonl", lines), out, model) == 0
    got = _by_id(out)
    _check_good(got, clean)
    for k, (_, field) in POISON.items():
        (line,) = got[f"poison-{k}"]
        assert line["error"]["code"] == "invalid_request", line
        assert field in line["error"]["message"], line


def test_table_rows_poisoned_per_row(model: str, tmp_path: Path) -> None:
    """Engine limits through a table's sampling_params (logprobs past max_logprobs, ...) and
    a NaN in an input column: those rows' errors, the others answered, the NaN kept."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    poison = [{"logprobs": 100000}, {"prompt_logprobs": 100000},
              {"seed": 2**64, "temperature": 0.8}, {"temperature": math.nan}]
    rows = [{"id": i, "prompt": f"Tell me fact {i}.", "score": math.nan if i == 3 else i / 2,
             "sampling_params": json.dumps(poison[i // 2] if i % 2 and i < 8 else
                                           {"temperature": 0})}
            for i in range(16)]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    out = tmp_path / "out.parquet"
    assert _run(src, out, model, "--max-tokens", "8") == 0
    got = pq.read_table(out).to_pylist()
    assert [r["id"] for r in got] == list(range(16))
    names = ["logprobs", "prompt_logprobs", "seed", "temperature"]
    for r in got:
        if r["id"] % 2 and r["id"] < 8:
            assert names[r["id"] // 2] in r["error"], r
        else:
            assert r["error"] is None and r["num_generated_tokens"] > 0, r
    assert math.isnan(got[3]["score"]) and got[4]["score"] == 2.0


def _faulty(monkeypatch: pytest.MonkeyPatch, fail: Callable[[Any, int], bool]) -> None:
    """Every runner the command makes gets an engine whose step raises when `fail(engine,
    step_number)` says so (the fake sits at the runner seam, not in the product)."""
    real = cli_main.make_runner

    def make(args: Any, record: Any) -> Any:
        runner = real(args, record)
        engine, step, count = runner.engine, runner.engine.step, [0]

        def failing_step() -> Any:
            count[0] += 1
            if fail(engine, count[0]):
                raise RuntimeError("injected step failure")
            return step()

        engine.step = failing_step
        return runner

    monkeypatch.setattr(cli_main, "make_runner", make)


def _poison_step(monkeypatch: pytest.MonkeyPatch, marker: str) -> None:
    """The model raises in any step (or probe of one) that samples the request whose prompt
    holds `marker`: a failure that follows one row, as a bad value would."""
    real = cli_main.make_runner

    def make(args: Any, record: Any) -> Any:
        runner = real(args, record)
        poisoned: set[str] = set()
        submit, run = runner.driver.submit, runner.engine.runner.run

        def watching_submit(*a: Any, **kw: Any) -> Any:
            if marker in (kw.get("prompt") or ""):
                poisoned.add(kw["request_id"])
            return submit(*a, **kw)

        def failing_run(inp: Any) -> Any:
            if any(s.request_id in poisoned for s in inp.sample_seqs):
                raise RuntimeError("injected failure of one row")
            return run(inp)

        runner.driver.submit = watching_submit
        runner.engine.runner.run = failing_run
        return runner

    monkeypatch.setattr(cli_main, "make_runner", make)


def test_a_step_that_fails_for_one_row_fails_that_row_only(
        model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        clean: dict[str, tuple[str, int]]) -> None:
    lines = [_line(i) for i in range(GOOD)]
    poison = _line(0)
    poison["custom_id"] = "poison-step"
    poison["body"]["messages"][0]["content"] = "POISON fact."
    lines.insert(GOOD // 2, poison)
    out = tmp_path / "out.jsonl"
    _poison_step(monkeypatch, "POISON")
    assert _run(_write(tmp_path / "in.jsonl", lines), out, model) == 0
    got = _by_id(out)
    _check_good(got, clean)
    (line,) = got["poison-step"]
    assert line["error"]["code"] == "generation_failed", line
    assert "injected failure of one row" in line["error"]["message"]


def test_an_engine_that_dies_mid_run_is_retried_by_resume(
        model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        clean: dict[str, tuple[str, int]]) -> None:
    src = _write(tmp_path / "in.jsonl", [_line(i) for i in range(GOOD)])
    out = tmp_path / "out.jsonl"
    _faulty(monkeypatch, lambda engine, n: n == 30)
    assert _run(src, out, model) == 1
    first = _by_id(out)
    failed = [k for k, v in first.items() if v[0]["error"] is not None]
    assert failed and all(first[k][0]["error"]["code"] == "engine_failed" for k in failed)
    assert len(first) < GOOD  # what was never submitted is not written either
    monkeypatch.undo()
    assert _run(src, out, model, "--resume") == 0
    _check_good(_by_id(out), clean)


def test_two_runs_on_one_output(model: str, tmp_path: Path) -> None:
    """The second run fails at once naming the first, and never opens the output: the first
    run's lines stay whole (two unlocked runs left NUL bytes and lost rows)."""
    src = _write(tmp_path / "in.jsonl", [_line(i, max_tokens=48) for i in range(64)])
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "batchgen_data.cli", "run", str(src), "-o", str(out),
           "--model", model, "--runner", "local", "--engine-kwargs", '{"max_num_seqs": 1}']
    first = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        second = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, timeout=120)
        assert first.poll() is None, "the first run ended before the second started"
        assert second.returncode == 2 and time.monotonic() - t0 < 30, second.stderr
        assert f"pid {first.pid}" in second.stderr and f"{out}.lock" in second.stderr
    finally:
        first.kill()
        first.wait()
    data = out.read_bytes()
    assert b"\0" not in data
    done = [json.loads(t) for t in data.decode().splitlines()[:-1]]  # the last may be torn
    assert len({x["custom_id"] for x in done}) == len(done)
