"""Which rows a job runs, as plain configuration: the one place a connector's arguments
(`task`, `program`, the defaults) become a kind of row.

A `RowKind` is picklable (Spark ships it with the UDF; a Ray actor builds its own from its
constructor arguments) and opens the `handler.RowHandler` for an engine's driver: generation
rows (`rows.GenerationRows`), a program's rows (`programs.ProgramRows`) or a pooling task's rows
(`pooling_rows.PoolingRows`). It also names the engine those rows run on (`build_engine`) and,
before any engine exists, the columns they add (`declared_schema`: Spark declares its output
type on the driver). The connectors ask nothing else about the kind.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen_data.connectors import row_extras
from batchgen_data.connectors.cells import to_python
from batchgen_data.connectors.common import INPUT_COLUMNS, ROW_COLUMNS, RequestBuilder
from batchgen_data.connectors.handler import RowHandler
from batchgen_data.connectors.pooling_rows import (
    PoolingRows, check_task, default_pooling_params, pooling_schema)
from batchgen_data.connectors.programs import ProgramRows, require_schema
from batchgen_data.connectors.rows import GenerationRows, output_schema
from batchgen_data.inputs.chat import check_template_kwargs
from batchgen_data.inputs.image_options import ImageOptions
from batchgen_data.programs.api import Program

GENERATE = "generate"


def build_engine(task: str, model: str | None, **engine_kwargs: Any) -> Any:
    """The engine rows of `task` run on (imports torch: executor side only)."""
    if task == GENERATE:
        from batchgen_data.engine.engine import Engine

        return Engine.from_kwargs(model, **engine_kwargs)
    from batchgen_data.engine.pooling import PoolingEngine

    return PoolingEngine.from_kwargs(model, **engine_kwargs)


def value_row(value: Any, column: str | None = None) -> dict[str, Any]:
    """A prompt cell as a row: chat messages, token ids, or (anything else) a prompt.

    A `column` named like an input column says what the cell is (an empty list has no type).
    """
    value = to_python(value)
    if column in INPUT_COLUMNS:
        return {column: value}
    if isinstance(value, list) and value:
        return {"messages" if isinstance(value[0], dict) else "prompt_token_ids": value}
    return {"prompt": value}


@dataclass(frozen=True)
class RowKind:
    """A job's rows: `task` "generate" (one request per row, or `program` per row) or a pooling
    task ("embed", "classify", "score"), with the defaults every row starts from."""

    task: str = GENERATE
    sampling_params: Mapping[str, Any] | None = None  # generation defaults, as a dict
    program: Any = None  # a @batchgen_data.program run on every row (docs/programs.md)
    pooling_params: Mapping[str, Any] | None = None  # PoolingParams fields for every row
    apply_chat_template: bool = True
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    # how rows' images are prepared (limit_mm_per_prompt, mm_processor_kwargs: from the
    # engine kwargs, inputs/image_options.py)
    image_options: ImageOptions | None = None

    @classmethod
    def create(cls, task: str = GENERATE, sampling_params: Any = None, program: Any = None,
               pooling_params: Any = None, apply_chat_template: bool = True,
               chat_template: str | None = None,
               chat_template_kwargs: Mapping[str, Any] | None = None,
               image_options: ImageOptions | None = None) -> "RowKind":
        """Checked where the job is written, so a typo fails before any engine loads; the
        generation defaults become a plain dict (`response_format` lifted), which pickles
        anywhere. A pooling task runs no program and no sampling: those are not read."""
        if program is not None and not isinstance(program, Program):
            raise TypeError(f"program must be a @batchgen_data.program, got "
                            f"{type(program).__name__}")
        if task != GENERATE:
            check_task(task)
            default_pooling_params(pooling_params)
            return cls(task, None, None, pooling_params)
        params = row_extras.default_params(sampling_params).to_dict()
        return cls(task, params, program, None, apply_chat_template, chat_template,
                   check_template_kwargs(dict(chat_template_kwargs)
                                         if chat_template_kwargs is not None else None),
                   image_options)

    @property
    def pooling(self) -> bool:
        """A pooling task: one pass per row, no sampling, nothing to migrate."""
        return self.task != GENERATE

    def declared_schema(self) -> pa.Schema:
        """The columns the rows add, known before an engine exists (an embedding as a
        variable-size list); a program must declare its own (`@program(schema=...)`)."""
        if self.pooling:
            return pooling_schema(self.task)
        if self.program is not None:
            return require_schema(self.program, "Spark")
        return output_schema()

    def open(self, driver: Any, base_seed: int, on_error: str = "row",
             request_prefix: str = "row",
             on_engine_dead: Callable[[BaseException], None] | None = None,
             fixed_size: bool = True) -> RowHandler:
        """The handler for these rows on `driver`'s engine. `fixed_size`: an embedding column
        of the engine's size (False: the variable-size list `declared_schema` names)."""
        if self.pooling:
            return PoolingRows(driver, self.task, self.pooling_params, on_error, request_prefix,
                               on_engine_dead, fixed_size)
        builder = RequestBuilder.from_engine(driver.engine, self.sampling_params,
                                             self.apply_chat_template, self.chat_template,
                                             self.chat_template_kwargs, self.image_options)
        if self.program is not None:
            return ProgramRows(driver, builder, base_seed, self.program, on_error,
                               request_prefix, on_engine_dead)
        return GenerationRows(driver, builder, base_seed, on_error, request_prefix,
                              on_engine_dead)

    def input_columns(self, prompt_col: str) -> tuple[str, ...]:
        """The columns `row_of` reads from a table whose prompts sit in `prompt_col` (a program
        reads whatever it reads)."""
        if self.task == "score":
            return ("text_1", "text_2")
        return () if self.program is not None else (prompt_col,)

    def row_of(self, record: Mapping[str, Any], prompt_col: str) -> tuple[dict[str, Any], Any]:
        """A table row whose prompt sits in `prompt_col` (Spark's `generate_df`) as the
        handler reads it, and its seed key when the table has no id column: a generation row
        keeps its prompt (so its seed comes from the prompt) and the per-row columns of a
        request; a program gets the whole row; a pooling row the whole row, its prompt also
        as `prompt`."""
        if self.program is not None:
            return dict(record), None
        if self.pooling:
            row = dict(record)
            if prompt_col in row and self.task != "score":
                row["prompt"] = row[prompt_col]
            return row, None
        value = record[prompt_col]
        row = value_row(value, prompt_col)
        row.update({name: record[name] for name in ROW_COLUMNS if name in record})
        return row, value
