"""batchgen_data.report: the job summary counts errors by kind, blank generations and tokens."""
from __future__ import annotations

import json

import pyarrow as pa
import pytest

from batchgen_data.connectors.rows import error_row, output_schema
from batchgen_data.report import summarize
from batchgen_data.report.summary import JobReport, error_kind


def _good(text: str, prompt: int, generated: int, reason: str = "stop") -> dict:
    return {"generated_text": text, "generated_token_ids": list(range(generated)),
            "num_prompt_tokens": prompt, "num_generated_tokens": generated,
            "finish_reason": reason, "error": None}


ROWS = [
    _good("Paris.", 10, 3),
    _good("", 12, 1),  # the instruct model ended at once: a good row with nothing in it
    _good("  \n", 8, 2),  # blank counts as empty too
    _good("A long answer", 20, 16, "length"),
    error_row("prompt is null"),
    error_row("prompt has 12581 tokens; max_model_len is 2048"),
    error_row("prompt has 9000 tokens; max_model_len is 2048"),
    error_row("messages[0] needs string 'role' and 'content'"),
]


def test_error_kind_drops_particulars() -> None:
    assert error_kind("prompt has 12581 tokens; max_model_len is 2048") == "prompt has N tokens"
    assert error_kind("messages[1] needs string 'role' and 'content'") == \
        "messages[N] needs string 'role' and 'content'"
    assert error_kind("bad sampling_params: n=2; connectors emit one row") == "bad sampling_params"
    assert error_kind("") == "(no message)"


def test_error_kind_drops_where_the_error_was() -> None:
    # the command prefixes its input line, LLM.generate the prompt's index: both say where,
    # so two bad JSON lines are one kind, not "line N"
    assert error_kind("line 7: not valid JSON: Expecting value") == "not valid JSON"
    assert error_kind("line 12: not valid JSON: Extra data") == "not valid JSON"
    assert error_kind("prompts[3]: prompt is empty") == "prompt is empty"
    assert error_kind("outline 7: x") == "outline N"  # only a leading location is dropped


def test_summarize_counts_rows_errors_empty_and_tokens() -> None:
    report = summarize(ROWS, wall_s=2.0)
    assert (report.rows, report.good_rows, report.error_rows) == (8, 4, 4)
    assert report.errors == {"prompt is null": 1, "prompt has N tokens": 2,
                             "messages[N] needs string 'role' and 'content'": 1}
    assert report.empty == 2 and report.empty_fraction == pytest.approx(0.5)
    assert report.finish_reasons == {"stop": 3, "length": 1}  # error rows have no reason
    assert (report.prompt_tokens, report.generated_tokens) == (50, 22)
    assert report.rows_per_s == pytest.approx(4.0)
    assert report.tokens_per_s == pytest.approx(11.0)
    assert len(report.error_examples) == 3  # one message per kind


def test_table_and_dicts_give_the_same_report() -> None:
    table = pa.Table.from_pylist(ROWS, schema=output_schema()).append_column(
        "id", pa.array([f"r{i}" for i in range(len(ROWS))]))
    assert summarize(table) == summarize(ROWS)
    with pytest.raises(ValueError, match="missing columns"):
        summarize(table.drop_columns(["error"]))


def test_format_shows_every_figure() -> None:
    text = summarize(ROWS, wall_s=2.0).format()
    assert "8 (4 good, 4 errors)" in text
    assert "2 of 4 good rows (50.0%)" in text
    assert "length 1, stop 3" in text
    assert "50 prompt, 22 generated" in text
    assert "4.0 rows/s, 11.0 generated tokens/s" in text
    assert "      2  prompt has N tokens" in text
    # without a wall time there is no rate to print
    assert "rows/s" not in summarize(ROWS).format()


def test_empty_job_and_json() -> None:
    report = summarize([])
    assert report == JobReport(rows=0)
    assert report.empty_fraction == 0.0 and report.rows_per_s is None
    d = json.loads(json.dumps(summarize(ROWS, wall_s=4.0).to_dict()))
    assert d["empty"] == 2 and d["error_rows"] == 4 and d["rows_per_s"] == 2.0
