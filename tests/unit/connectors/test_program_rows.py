"""connectors/programs.py: a program's output dicts as columns, schema checks, seeds."""
from __future__ import annotations

import pyarrow as pa
import pytest

from batchgen_data import Generate, program
from batchgen_data.connectors.programs import (
    attach_program_outputs, program_output_schema, program_result_row, program_row_key,
    require_schema, step_seed)


@program(schema={"answer": "string", "votes": "list<string>", "n": "int64"})
def declared(row):  # type: ignore[no-untyped-def]
    yield Generate("x")
    return {}


@program
def undeclared(row):  # type: ignore[no-untyped-def]
    yield Generate("x")
    return {}


def test_declared_outputs_become_typed_columns_and_errors_stay_in_shape() -> None:
    schema = program_output_schema(declared)
    assert schema.names == ["answer", "votes", "n", "error"]
    table = pa.table({"id": [1, 2, 3], "answer": ["old", "old", "old"]})
    rows = [program_result_row({"answer": "a", "votes": ["x"], "n": 2}, schema),
            {"error": "program 'p' raised"},
            program_result_row({"answer": "c", "votes": [], "n": 1}, schema)]
    out = attach_program_outputs(table, [2, 0, 1], rows, schema)
    assert out.column_names == ["id", "answer", "votes", "n", "error"]  # input answer replaced
    assert out.to_pylist() == [
        {"id": 3, "answer": "a", "votes": ["x"], "n": 2, "error": None},
        {"id": 1, "answer": None, "votes": None, "n": None, "error": "program 'p' raised"},
        {"id": 2, "answer": "c", "votes": [], "n": 1, "error": None}]


def test_outputs_that_do_not_fit_the_schema_are_row_errors() -> None:
    schema = program_output_schema(declared)
    assert "not in its schema" in program_result_row({"answer": "a", "other": 1}, schema)["error"]
    assert "does not match its schema" in program_result_row({"n": "many"}, schema)["error"]


def test_undeclared_outputs_are_inferred_and_an_all_error_batch_still_has_error() -> None:
    assert program_output_schema(undeclared) is None
    with pytest.raises(ValueError, match="schema="):
        require_schema(undeclared, "Spark")
    table = pa.table({"id": [1, 2]})
    out = attach_program_outputs(table, [0, 1], [{"score": 1.5, "error": None},
                                                 {"error": "bad"}], None)
    assert out.to_pylist() == [{"id": 1, "score": 1.5, "error": None},
                               {"id": 2, "score": None, "error": "bad"}]
    only_errors = attach_program_outputs(table, [0], [{"error": "bad"}], None)
    assert only_errors.schema.field("error").type == pa.string()


def test_seeds_depend_on_row_step_and_slot_only() -> None:
    key = program_row_key({"q": "x", "id": 3})
    assert key == program_row_key({"id": 3, "q": "x"})  # column order does not matter
    seeds = {step_seed(0, key, s, k) for s in (1, 2) for k in (0, 1)}
    assert len(seeds) == 4 and step_seed(0, key, 1, 0) == step_seed(0, key, 1, 0)
    assert step_seed(1, key, 1, 0) != step_seed(0, key, 1, 0)
