"""Program rows: a row → its program → the program's columns (a `handler.RowLifecycle`).

With `program=` a connector hands each whole input row to the program (`batchgen_data.programs`,
run over the engine's driver by `programs.driven.DrivenPrograms`) instead of building one
request from it; the program's returned dict becomes the output columns, plus `error` (null
when fine). A declared schema (`@program(schema=...)`) fixes those
columns and their types: Spark needs it up front, and on Ray it keeps blocks with only error
rows the same shape as the others. An output that does not fit the schema is that row's error.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import pyarrow as pa

from batchgen_data.connectors.cells import to_python, with_outputs
from batchgen_data.connectors.common import RequestBuilder, derive_seed
from batchgen_data.connectors.handler import RowLifecycle

ERROR_FIELD = pa.field("error", pa.string())


def program_output_schema(program: Any) -> pa.Schema | None:
    """The program's declared columns plus `error`; None when it declared none."""
    if program.schema is None:
        return None
    return pa.schema([f for f in program.schema if f.name != "error"] + [ERROR_FIELD])


def require_schema(program: Any, where: str) -> pa.Schema:
    schema = program_output_schema(program)
    if schema is None:
        raise ValueError(f"{where} needs the program's output columns up front: declare them "
                         f"with @program(schema={{'answer': 'string', ...}})")
    return schema


def program_row_key(row: Mapping[str, Any]) -> str:
    """A stable seed key for a row without an id: its content (same row, same seed anywhere)."""
    return json.dumps(to_python(dict(row)), sort_keys=True, default=str)


def step_seed(base_seed: int, key: Any, step: int, slot: int) -> int:
    """The seed of an unseeded step: from the row, the step and the slot, so a retried task or
    a replayed program samples the same tokens, and the n samples of a vote differ."""
    return derive_seed(base_seed, f"{key}\x00{step}\x00{slot}")


def program_result_row(output: Mapping[str, Any], schema: pa.Schema | None) -> dict[str, Any]:
    """Output columns of a finished program; an output the schema cannot hold is an error."""
    row = {**output, "error": None}
    if schema is None:
        return row
    extra = sorted(set(output) - set(schema.names))
    if extra:
        return program_error_row(f"program returned columns {extra} not in its schema "
                                 f"{schema.names[:-1]}")
    try:
        pa.Table.from_pylist([row], schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
        return program_error_row(f"program output does not match its schema: {e}")
    return row


def program_error_row(message: str) -> dict[str, Any]:
    return {"error": message}


def attach_program_outputs(table: pa.Table, indices: Sequence[int],
                           rows: Sequence[Mapping[str, Any]], schema: pa.Schema | None
                           ) -> pa.Table:
    """Input rows `indices` of `table`, all columns kept, with the program's columns appended
    (an input column named like an output column is replaced)."""
    if schema is not None:
        return with_outputs(table, indices, pa.Table.from_pylist(list(rows), schema=schema))
    names = list(dict.fromkeys(k for r in rows for k in r if k != "error")) + ["error"]
    outputs = pa.Table.from_pylist([{n: r.get(n) for n in names} for r in rows])
    if outputs.schema.field("error").type == pa.null():
        outputs = outputs.set_column(len(names) - 1, ERROR_FIELD, pa.nulls(len(rows), pa.string()))
    return with_outputs(table, indices, outputs)


class ProgramRows(RowLifecycle):
    """Rows of one engine in, one program run each; finished Futures become its columns."""

    def __init__(self, driver: Any, builder: RequestBuilder, base_seed: int, program: Any,
                 on_error: str = "row", request_prefix: str = "row",
                 on_engine_dead: Callable[[BaseException], None] | None = None) -> None:
        from batchgen_data.programs.driven import DrivenPrograms  # imports the engine side

        super().__init__(driver, on_error, request_prefix, on_engine_dead)
        self.programs = DrivenPrograms(
            driver, program, builder.default_params, seed_for=lambda key, step, slot:
            step_seed(base_seed, key, step, slot), prefix=f"{request_prefix}-program",
            is_engine_dead=self.is_engine_dead, lora_for=builder.lora_for)
        self.schema = program_output_schema(program)

    def _start(self, row: Mapping[str, Any], key: Any, alone: bool) -> tuple[Future, None]:
        """The whole row goes to the program (`alone` does not apply: a program's steps are
        its own requests); its failures arrive through the Future."""
        return self.programs.submit(dict(row), program_row_key(row) if key is None else key), None

    def _columns(self, result: Any) -> dict[str, Any]:
        return program_result_row(result, self.schema)

    def _error_columns(self, message: str) -> dict[str, Any]:
        return program_error_row(message)

    def output_schema(self) -> pa.Schema | None:
        return self.schema

    def attach(self, table: pa.Table, indices: Sequence[int],
               rows: Sequence[Mapping[str, Any]]) -> pa.Table:
        return attach_program_outputs(table, indices, rows, self.schema)

    def _abort(self, futures: list[Future], request_ids: list[str]) -> None:
        self.programs.abandon(futures)

    def close(self) -> None:
        self.programs.shutdown()
