"""Output files: appended and flushed per request, read back by --resume (torn last line)."""
from __future__ import annotations

import io
import json
from pathlib import Path

from batchgen_data.cli.inputs import ROW_KEY, read_input
from batchgen_data.cli.outputs import BatchOutput, TableOutput
from batchgen_data.cli.progress import Progress
from batchgen_data.openai.batch_output import error_line


def test_resume_reads_keys_and_cuts_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    out = BatchOutput(path, resume=False)
    out.write(error_line("a", "invalid_request", "line 1: x"))
    out.write(error_line(None, "invalid_json", "line 2: not valid JSON"))
    out.write(error_line("a", "duplicate_custom_id", "line 3: custom_id 'a' was already used"))
    assert path.read_text().count("\n") == 3  # flushed: a reader sees every line at once
    out.close()
    with path.open("a") as f:
        f.write('{"id": "batch_req_x", "custom_id": "b", "resp')  # killed mid-write
    again = BatchOutput(path, resume=True)
    assert again.done == {"a", "line 2", "line 3"}
    again.write(error_line("b", "invalid_request", "line 4: y"))
    again.close()
    lines = [json.loads(t) for t in path.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["a", None, "a", "b"]


def test_without_resume_the_output_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text('{"custom_id": "old"}\n')
    out = BatchOutput(path, resume=False)
    assert out.done == set()
    out.close()
    assert path.read_text() == ""


def test_table_output_is_written_in_input_order(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    final = tmp_path / "out.parquet"
    out = TableOutput(final, resume=False)
    out.write({ROW_KEY: 1, "prompt": "b", "generated_text": "B"})
    out.close()
    out = TableOutput(final, resume=True)  # a second run adds the rest
    assert out.done == {"1"}
    out.write({ROW_KEY: 0, "prompt": "a", "generated_text": "A"})
    out.finish()
    assert pq.read_table(final).to_pylist() == [{"prompt": "a", "generated_text": "A"},
                                                {"prompt": "b", "generated_text": "B"}]
    assert not (tmp_path / "out.parquet.partial.jsonl").exists()
    done = TableOutput(final, resume=True)  # the run had finished: nothing is left to do
    assert done.done == {"0", "1"}
    done.finish()
    assert pq.read_table(final).num_rows == 2


def test_batch_input_duplicates_and_table_detection(tmp_path: Path) -> None:
    batch = tmp_path / "in.jsonl"
    body = {"messages": [{"role": "user", "content": "x"}]}
    batch.write_text("\n".join(json.dumps({"custom_id": c, "url": "/v1/chat/completions",
                                           "body": body}) for c in ("a", "b", "a")) + "\n\n")
    f = read_input(batch, default_max_tokens=5)
    assert f.is_batch and [i.key for i in f.items] == ["a", "b", "line 3"]
    assert f.items[2].error_code == "duplicate_custom_id"
    assert f.items[0].row["sampling_params"] == {"max_tokens": 5}
    table = tmp_path / "t.jsonl"
    table.write_text('{"id": 1, "prompt": "hi"}\n{"id": 2, "prompt": "yo"}\n')
    f = read_input(table)
    assert not f.is_batch and [i.key for i in f.items] == ["0", "1"]


def test_progress_line_counts_rates_and_eta() -> None:
    now = [100.0]
    stream = io.StringIO()
    p = Progress(10, already_done=2, stream=stream, interval_s=0.0, clock=lambda: now[0])
    now[0] = 102.0
    p.update(error=False, tokens=30)
    p.update(error=True)
    assert p.line() == ("[batchgen] 4/10 rows | 1.00 rows/s | 15.0 out tok/s | ETA 6s | "
                        "errors 1")
    assert stream.getvalue().count("\n") == 2  # not a terminal: whole lines
