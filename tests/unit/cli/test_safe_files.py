"""The command's data-loss paths (issue 57), without an engine: an output that is the input,
two runs on one output, links planted beside the output, engine failures read back by
`--resume`, and NaN values in rows."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from batchgen_data.cli.inputs import ROW_KEY
from batchgen_data.cli.main import main
from batchgen_data.cli.outputs import ENGINE_FAILED, RETRY_KEY, BatchOutput, TableOutput
from batchgen_data.cli.safe_files import OutputLock, OutputLocked, open_nofollow
from batchgen_data.openai.batch_output import error_line

REQUEST = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
           "body": {"messages": [{"role": "user", "content": "hi"}]}}


def _input(tmp_path: Path) -> tuple[Path, bytes]:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(REQUEST) + "\n")
    return src, src.read_bytes()


@pytest.mark.parametrize("how", ["same path", "symlink", "hard link"])
def test_an_output_that_is_the_input_is_refused_before_anything_is_written(
        tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]) -> None:
    src, before = _input(tmp_path)
    out = src if how == "same path" else tmp_path / "out.jsonl"
    if how == "symlink":
        out.symlink_to(src)
    elif how == "hard link":
        os.link(src, out)
    for flag in ("-o", "--report"):
        argv = ["run", str(src), "-o", str(out) if flag == "-o" else str(tmp_path / "o.jsonl"),
                "--runner", "local", "--model", str(tmp_path / "no-model")]
        if flag == "--report":
            argv += ["--report", str(out)]
        assert main(argv) == 2
        assert src.read_bytes() == before  # not truncated, not appended to
        assert "is the input file" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_a_second_run_on_the_same_output_fails_at_once_naming_the_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, _ = _input(tmp_path)
    out = tmp_path / "out.jsonl"
    out.write_text("a line the first run wrote\n")
    first = OutputLock(out)  # the other run: its own open of the lock file
    first.acquire()
    try:
        assert main(["run", str(src), "-o", str(out), "--runner", "local"]) == 2
        err = capsys.readouterr().err
        assert f"pid {os.getpid()}" in err and str(first.path) in err
        assert out.read_text() == "a line the first run wrote\n"  # untouched
        with pytest.raises(OutputLocked, match="another batchgen-data run"):
            OutputLock(out).acquire()
    finally:
        first.release()
    assert not first.path.exists()  # released and removed by its holder


def test_a_lock_file_left_by_a_killed_run_does_not_block(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.lock").write_text('{"pid": 1, "host": "gone"}\n')  # no flock held
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    assert main(["run", str(src), "-o", str(out), "--runner", "local"]) == 0
    assert out.read_text() == "" and not (tmp_path / "out.jsonl.lock").exists()


@pytest.mark.parametrize("planted", ["out.parquet.partial.jsonl", "out.parquet.lock",
                                     "report.html"])
def test_links_beside_the_output_are_not_followed(tmp_path: Path, planted: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (tmp_path / planted).symlink_to(victim)
    rc = main(["run", str(src), "-o", str(tmp_path / "out.parquet"), "--runner", "local",
               "--report", str(tmp_path / "report.html")])
    assert rc == 2 and "symbolic link" in capsys.readouterr().err
    assert victim.read_text() == "keep me\n"
    with pytest.raises(ValueError, match="symbolic link"):
        open_nofollow(tmp_path / planted, "w")


def test_resume_runs_engine_failures_again_and_keeps_row_errors(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    out = BatchOutput(path, resume=False)
    out.write(error_line("good-error", "invalid_request", "line 1: temperature=nan"))
    out.write(error_line("row-failed", "generation_failed", "line 2: RequestFailedError: x"))
    out.write(error_line("dead", ENGINE_FAILED, "line 3: EngineDeadError: engine loop died"))
    out.write(error_line("dead-old", "generation_failed",
                         "line 4: EngineDeadError: engine loop died: OverflowError()"))
    assert out.done == {"good-error", "row-failed"}  # an engine failure is never done
    out.close()
    again = BatchOutput(path, resume=True)
    assert again.done == {"good-error", "row-failed"} and again.retried == 2
    again.close()
    ids = [json.loads(t)["custom_id"] for t in path.read_text().splitlines()]
    assert ids == ["good-error", "row-failed"]  # the failures are gone, to be answered anew

    table = TableOutput(tmp_path / "t.parquet", resume=False)
    table.write({ROW_KEY: 0, "prompt": "a", "error": None})
    table.write({ROW_KEY: 1, "prompt": "b", "error": "EngineDeadError: x", RETRY_KEY: True})
    table.close()
    assert TableOutput(tmp_path / "t.parquet", resume=True).done == {"0"}


def test_nan_in_a_row_is_written_not_fatal(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    for suffix in ("parquet", "jsonl"):
        table = TableOutput(tmp_path / f"t.{suffix}", resume=False)
        table.write({ROW_KEY: 0, "prompt": "a", "score": float("nan"), "error": None})
        table.write({ROW_KEY: 1, "prompt": "b", "score": 0.5, "error": None})
        table.finish()
    assert math.isnan(pq.read_table(tmp_path / "t.parquet").column("score")[0].as_py())
    rows = [json.loads(t) for t in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [r["score"] for r in rows] == [None, 0.5]  # strict JSON has no NaN
    batch = BatchOutput(tmp_path / "b.jsonl", resume=False)
    batch.write({"custom_id": "x", "error": None, "response": {"body": {"v": float("-inf")}}})
    batch.close()
    assert json.loads((tmp_path / "b.jsonl").read_text())["response"]["body"]["v"] is None
