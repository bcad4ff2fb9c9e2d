"""The Arrow/pandas ⇄ request layer shared by the Ray Data and Spark connectors.

A connector sees rows; the engine sees `(prompt_token_ids, SamplingParams)`. This module is the
one place that turns a row into a request (or into a clear error message, so that a bad row
never crashes a job) and a finished request back into output columns. It knows nothing about
Ray or Spark and imports neither.

    builder = RequestBuilder.from_engine(engine, default_params={"max_tokens": 32})
    for row in batch_rows(table):
        try:
            req = builder.build(row)          # RowRequest(prompt_token_ids, params, prompt)
        except RowError as e:
            out = error_row(str(e))           # empty outputs, `error` set
        ...
        out = result_row(request_output)      # generated_text, ..., error=None
    table_out = attach_outputs(table, row_indices, out_rows)   # input columns kept

Input columns, first non-null wins: `prompt_token_ids` (list of ints, never templated),
`messages` (OpenAI chat list), `prompt` (str). Optional `sampling_params`: a dict/struct (or JSON
string) of per-row overrides. With `apply_chat_template=True` (the default) `messages` go through
the tokenizer's chat template, and so does a plain `prompt`, as one user turn, when the
tokenizer has a template: an instruct model given a bare prompt often ends its answer at once.
Such a row gives the same tokens as `LLM.chat`; with `apply_chat_template=False` a prompt is sent
raw, as `LLM.generate` sends it, and `messages` is an ordinary column.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from batchgen_data.inputs.chat import check_template_kwargs, has_chat_template, prompt_as_chat, render_chat
from batchgen_data.connectors import row_extras
from batchgen_data.lora_request import (
    LORA_COLUMN, MODEL_COLUMN, AdapterNames, LoRARequest, no_adapters)
from batchgen_data.inputs.prompt_checks import check_prompt_text, first_bad_token
from batchgen_data.sampling_params import SamplingParams
from batchgen_data.structured import json_text

INPUT_COLUMNS = ("prompt_token_ids", "messages", "prompt")
PARAMS_COLUMN = "sampling_params"
LORA_FIELDS = (LORA_COLUMN, MODEL_COLUMN)  # a row's adapter (lora_request.AdapterNames)
OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "num_prompt_tokens",
                  "num_generated_tokens", "finish_reason", "error",
                  *(f.name for f in row_extras.output_fields()))


class RowError(ValueError):
    """A row the engine cannot take; its message becomes the row's `error` value."""


@dataclass(frozen=True, slots=True)
class RowRequest:
    """One validated row, ready for `EngineDriver.submit(prompt_token_ids, params, prompt=)`."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    lora: LoRARequest | None = None  # the adapter the row names (lora_request.AdapterNames)


def output_schema() -> pa.Schema:
    """Arrow schema of the columns both connectors append to every input row."""
    return pa.schema([
        pa.field("generated_text", pa.string()),
        pa.field("generated_token_ids", pa.list_(pa.int32())),
        pa.field("num_prompt_tokens", pa.int32()),
        pa.field("num_generated_tokens", pa.int32()),
        pa.field("finish_reason", pa.string()),
        pa.field("error", pa.string()),
        *row_extras.output_fields(),  # logprobs, top_logprobs, samples (n > 1)
    ])


def result_row(out: Any) -> dict[str, Any]:
    """Output columns for a finished `RequestOutput` (its first completion)."""
    c = out.outputs[0]
    return {"generated_text": c.text, "generated_token_ids": list(c.token_ids),
            "num_prompt_tokens": len(out.prompt_token_ids), "num_generated_tokens": len(c.token_ids),
            "finish_reason": c.finish_reason, "error": None, **row_extras.result_columns(out)}


def error_row(message: str) -> dict[str, Any]:
    """Output columns for a row that produced nothing: empty outputs, `error` = message."""
    return {"generated_text": "", "generated_token_ids": [], "num_prompt_tokens": 0,
            "num_generated_tokens": 0, "finish_reason": None, "error": message,
            **row_extras.empty_columns()}


def to_python(value: Any) -> Any:
    """Plain Python for one cell: numpy arrays/scalars → lists/scalars, NaN/NA → None.

    pandas and numpy batches hold lists as numpy object arrays and missing strings as NaN;
    validation and chat templates want plain lists, dicts and None.
    """
    if value is None:
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    if type(value).__name__ in ("NAType", "NaTType"):
        return None
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # numpy array or scalar
        return to_python(value.tolist())
    return value


def to_arrow(batch: Any) -> pa.Table:
    """Any batch Ray or Spark hands over (Arrow table/record batch, pandas, dict of columns)."""
    if isinstance(batch, pa.Table):
        return batch
    if isinstance(batch, pa.RecordBatch):
        return pa.Table.from_batches([batch])
    if isinstance(batch, Mapping):
        return pa.table({k: pa.array(to_python(list(v))) for k, v in batch.items()})
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas, imported lazily
        return pa.table({c: pa.array([to_python(v) for v in batch[c].tolist()])
                         for c in batch.columns})
    raise TypeError(f"unsupported batch type {type(batch).__name__}")


def batch_rows(batch: Any) -> list[dict[str, Any]]:
    """The rows of a batch as plain dicts (see `to_python`)."""
    return to_arrow(batch).to_pylist()


def attach_outputs(table: pa.Table, indices: Sequence[int],
                   rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Input rows `indices` of `table`, all columns kept, with the output columns appended.

    An input column that already has an output column's name is replaced by the new value.
    """
    assert len(indices) == len(rows), (len(indices), len(rows))
    kept = table.take(pa.array(indices, type=pa.int64()))
    kept = kept.drop_columns([c for c in OUTPUT_COLUMNS if c in kept.column_names])
    outputs = pa.Table.from_pylist(list(rows), schema=output_schema())
    for field, column in zip(outputs.schema, outputs.columns):
        kept = kept.append_column(field, column)
    return kept


def encode_prompt(value: Any, tokenizer: Any, column: str = "prompt",
                  as_chat: bool = False, chat: Mapping[str, Any] | None = None
                  ) -> tuple[list[int], str | None]:
    """(prompt_token_ids, prompt text) for one input value, or RowError naming the problem.

    `as_chat`: a plain prompt is rendered as one user turn of the chat template; `chat`: the
    renderer's `chat_template` / `chat_template_kwargs`.
    """
    chat = chat or {}
    value = to_python(value)
    if column == "prompt_token_ids":
        bad = first_bad_token(value)  # the vocabulary is checked with the engine's limits
        if bad is not None:
            raise RowError(bad)
        return value, None
    if column == "messages":
        return _rendered(render_chat, tokenizer, value, chat)
    try:
        check_prompt_text(value)  # the same messages as LLM.generate (prompt_checks)
    except (TypeError, ValueError) as e:
        raise RowError(str(e)) from None
    if as_chat:
        return _rendered(prompt_as_chat, tokenizer, value, chat)
    return tokenizer.encode(value), value


def _rendered(render: Callable[..., tuple[list[int], str]], tokenizer: Any,
              value: Any, chat: Mapping[str, Any]) -> tuple[list[int], str]:
    try:
        return render(tokenizer, value, **chat)
    except ValueError as e:  # the chat module's message names the bad message
        raise RowError(str(e)) from None


def parse_overrides(value: Any) -> dict[str, Any] | None:
    """Per-row sampling overrides: dict/struct, JSON object string, or null.

    A float field keeps its NaN: here it is a bad value to report, not a missing cell.
    """
    if isinstance(value, Mapping):
        value = {k: float(v) if isinstance(v, float) else to_python(v) for k, v in value.items()}
    else:
        value = to_python(value)
    if value is None:
        return None
    if isinstance(value, str):
        value = json_text(value, "sampling_params", RowError)
    if not isinstance(value, dict):
        raise RowError(f"sampling_params must be a dict, got {type(value).__name__}")
    value = {k: v for k, v in value.items() if v is not None}
    return row_extras.lift_structured(value, RowError)


class RequestBuilder:
    """Validates rows against one engine's tokenizer and limits and turns them into RowRequests."""

    def __init__(self, tokenizer: Any, default_params: SamplingParams | Mapping[str, Any] | None = None,
                 check: Callable[[list[int], SamplingParams], None] | None = None,
                 apply_chat_template: bool = True, chat_template: str | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None,
                 adapters: AdapterNames | None = None,
                 check_lora: Callable[[LoRARequest], None] | None = None) -> None:
        self.tokenizer = tokenizer
        # how rows name LoRA adapters (None: the engine has none) and engine.check_lora
        self.adapters, self.check_lora = adapters, check_lora
        # without the chat template a `messages` column is just another passed-through column
        self.columns = INPUT_COLUMNS if apply_chat_template else tuple(
            c for c in INPUT_COLUMNS if c != "messages")
        # plain prompts as one user turn: what an instruct model expects (docs/row-errors.md)
        self.prompts_as_chat = apply_chat_template and has_chat_template(tokenizer, chat_template)
        self.chat_template = chat_template
        self.chat_template_kwargs = check_template_kwargs(
            dict(chat_template_kwargs) if chat_template_kwargs is not None else None)
        self.default_params = row_extras.default_params(default_params)
        # engine.check_request: raises ValueError for prompts too long, token ids out of vocab
        self.check = check

    @classmethod
    def from_engine(cls, engine: Any, default_params: Any = None,
                    apply_chat_template: bool = True, chat_template: str | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> "RequestBuilder":
        return cls(engine.tokenizer, default_params, engine.check_request, apply_chat_template,
                   chat_template, chat_template_kwargs,
                   # engines without adapters (pooling, fakes in tests) have no such questions
                   getattr(engine, "lora_names", lambda: None)(),
                   getattr(engine, "check_lora", None))

    def build(self, row: Mapping[str, Any]) -> RowRequest:
        """The RowRequest for one row; RowError with a message naming the problem otherwise."""
        present = [c for c in self.columns if c in row]
        if not present:
            raise RowError(f"row has none of the input columns {list(self.columns)[::-1]}")
        column = next((c for c in present if to_python(row[c]) is not None), present[-1])
        ids, text = encode_prompt(row[column], self.tokenizer, column, self.prompts_as_chat,
                                  self._chat_options(row))
        params = self.params_for(row.get(PARAMS_COLUMN), row)
        if self.check is not None:
            try:
                self.check(ids, params)
            except (ValueError, TypeError) as e:
                raise RowError(str(e)) from None
        return RowRequest(ids, params, text, self.lora_for(row))

    def lora_for(self, row: Mapping[str, Any]) -> LoRARequest | None:
        """The adapter `row` names, read and checked by the engine; RowError when it names one
        that cannot run (unknown, unloadable, or no enable_lora)."""
        try:
            if self.adapters is None:
                no_adapters(row, to_python)
                return None
            lora = self.adapters.request(row, to_python)
            if lora is not None and self.check_lora is not None:
                self.check_lora(lora)
        except (ValueError, TypeError) as e:
            raise RowError(str(e)) from None
        return lora

    def params_for(self, overrides: Any, row: Mapping[str, Any] | None = None) -> SamplingParams:
        """Defaults merged with one row's overrides (and its structured-output columns);
        RowError when they are invalid."""
        over = parse_overrides(overrides)  # its RowError names the column already
        try:
            params = self.default_params.merged(over)
            if over and "structured_outputs" in over and over["structured_outputs"] is None:
                # response_format {"type": "text"}: this row is free even if the default is not
                params = replace(params, structured_outputs=None)
        except (TypeError, ValueError) as e:
            raise RowError(f"bad sampling_params: {e}") from None
        return row_extras.with_row_structured(params, row) if row else params

    def _chat_options(self, row: Mapping[str, Any]) -> dict[str, Any]:
        try:
            kwargs = row_extras.template_kwargs(row.get("chat_template_kwargs"),
                                                self.chat_template_kwargs)
        except ValueError as e:
            raise RowError(str(e)) from None
        return {"chat_template": self.chat_template, "chat_template_kwargs": kwargs}

    def try_build(self, row: Mapping[str, Any]) -> RowRequest | str:
        """Like `build`, but returns the error message instead of raising."""
        try:
            return self.build(row)
        except RowError as e:
            return str(e)


def lora_kwargs(lora: LoRARequest | None) -> dict[str, Any]:
    """`lora_request=` for a driver's submit when the row names an adapter (drivers faked at
    the connectors' seam need not know the argument otherwise)."""
    return {} if lora is None else {"lora_request": lora}


class UniqueIds:
    """The ids one task has seen: where rows are keyed by an id column, a row whose id is null
    or repeated is a row error (its output could not be told from the other's, and resuming
    skips rows by id)."""

    def __init__(self, column: str) -> None:
        self.column = column
        self._seen: set[Any] = set()

    def problem(self, key: Any) -> str | None:
        """The row error for `key`, or None (and `key` is remembered)."""
        if key is None:
            return f"{self.column} is null: id_col={self.column!r} needs an id in every row"
        mark = key if isinstance(key, (str, int, float, bytes)) else repr(key)
        if mark in self._seen:
            return f"{self.column}={key!r} appears more than once (id_col={self.column!r})"
        self._seen.add(mark)
        return None


def derive_seed(base_seed: int, key: str) -> int:
    """Stable per-row seed: the same row gets the same seed in every attempt of a task.

    Python's hash() is salted per process, so a retried task on another worker would differ;
    blake2b is not. 31 bits keep the value valid for every RNG the engine might seed.
    """
    digest = hashlib.blake2b(f"{base_seed}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


def seeded(params: SamplingParams, base_seed: int, key: Any) -> SamplingParams:
    """`params`, seeded from the row itself when neither the user nor the row gave a seed.

    The key identifies the row (an id column, or its prompt), so a retried or speculative task,
    or a row that migrates to another engine, samples the same tokens wherever it runs.
    """
    if params.seed is not None:
        return params
    return replace(params, seed=derive_seed(base_seed, str(key)))
