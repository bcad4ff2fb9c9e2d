"""Row → request: the one place a connector turns an input row into an engine request.

A connector sees rows; the engine sees `(prompt_token_ids, SamplingParams)`. `RequestBuilder`
turns a row into a `RowRequest`, or into a `RowError` naming the problem, so that a bad row
never crashes a job; `rows.GenerationRows` submits it and turns the result into output
columns. It knows nothing about Ray or Spark and imports neither.

    builder = RequestBuilder.from_engine(engine, default_params={"max_tokens": 32})
    req = builder.build(row)          # RowRequest(prompt_token_ids, params, prompt, lora)

Input columns, first non-null wins: `prompt_token_ids` (list of ints, never templated),
`messages` (OpenAI chat list), `prompt` (str). Optional `sampling_params`: a dict/struct (or JSON
string) of per-row overrides; the other per-row columns a request reads are `ROW_COLUMNS`
(structured output, chat-template options: row_extras.py; a LoRA adapter). With
`apply_chat_template=True` (the default) `messages` go through the tokenizer's chat template,
and so does a plain `prompt`, as one user turn, when the tokenizer has a template: an instruct
model given a bare prompt often ends its answer at once. Such a row gives the same tokens as
`LLM.chat`; with `apply_chat_template=False` a prompt is sent raw, as `LLM.generate` sends it,
and `messages` is an ordinary column.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from batchgen_data.connectors import row_extras
from batchgen_data.connectors.cells import to_python
from batchgen_data.connectors.handler import RowError
from batchgen_data.connectors.image_rows import column_images_of, prompt_with_images
from batchgen_data.inputs.chat import (
    check_template_kwargs, has_chat_template, prompt_as_chat, render_chat)
from batchgen_data.inputs.image_input import ImageInput
from batchgen_data.inputs.image_options import ImageOptions
from batchgen_data.inputs.image_parts import IMAGE_COLUMNS, has_parts
from batchgen_data.inputs.images import LazyPreparer
from batchgen_data.inputs.prompt_checks import check_prompt_text, first_bad_token
from batchgen_data.lora_request import (
    LORA_COLUMN, MODEL_COLUMN, AdapterNames, LoRARequest, no_adapters)
from batchgen_data.sampling_params import SamplingParams
from batchgen_data.structured import json_text

INPUT_COLUMNS = ("prompt_token_ids", "messages", "prompt")
PARAMS_COLUMN = "sampling_params"
LORA_FIELDS = (LORA_COLUMN, MODEL_COLUMN)  # a row's adapter (lora_request.AdapterNames)
# the columns of a row a request reads besides its prompt (a connector that passes a prompt
# column alone copies these along)
ROW_COLUMNS = (PARAMS_COLUMN, *row_extras.ROW_FIELDS, *LORA_FIELDS, *IMAGE_COLUMNS)


@dataclass(frozen=True, slots=True)
class RowRequest:
    """One validated row, ready for `EngineDriver.submit(prompt_token_ids, params, prompt=)`."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    lora: LoRARequest | None = None  # the adapter the row names (lora_request.AdapterNames)
    images: tuple[ImageInput, ...] = ()  # its images, placeholders expanded in the ids


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
                 check_lora: Callable[[LoRARequest], None] | None = None,
                 images: LazyPreparer | None = None) -> None:
        self.tokenizer = tokenizer
        # the model's image pipeline, loaded by the first row with an image (inputs/images.py)
        self.images = images if images is not None else LazyPreparer(tokenizer)
        # how rows name LoRA adapters (None: the engine has none) and engine.check_lora
        self.adapters, self.check_lora = adapters, check_lora
        # without the chat template a `messages` column is just another passed-through column
        self.apply_chat_template = apply_chat_template
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
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    image_options: ImageOptions | None = None) -> "RequestBuilder":
        """The builder for a generation engine's rows (`engine.protocol.GenerationEngine`:
        its tokenizer, entry checks and the adapters rows may name)."""
        return cls(engine.tokenizer, default_params, engine.check_request, apply_chat_template,
                   chat_template, chat_template_kwargs, engine.lora_names(), engine.check_lora,
                   LazyPreparer(engine.tokenizer, image_options))

    def build(self, row: Mapping[str, Any]) -> RowRequest:
        """The RowRequest for one row; RowError with a message naming the problem otherwise."""
        present = [c for c in self.columns if c in row]
        if not present:
            raise RowError(f"row has none of the input columns {list(self.columns)[::-1]}")
        column = next((c for c in present if to_python(row[c]) is not None), present[-1])
        images = column_images_of(row)
        value = to_python(row[column])
        if images or (column == "messages" and has_parts(value)):
            ids, text, mm = self.with_images(column, value, images, row)
        else:
            (ids, text), mm = encode_prompt(value, self.tokenizer, column, self.prompts_as_chat,
                                            self._chat_options(row)), ()
        params = self.params_for(row.get(PARAMS_COLUMN), row)
        if self.check is not None:
            try:
                self.check(ids, params)
            except (ValueError, TypeError) as e:
                raise RowError(str(e)) from None
        return RowRequest(ids, params, text, self.lora_for(row), mm)

    def with_images(self, column: str, value: Any, images: list[Any],
                    row: Mapping[str, Any]) -> tuple[list[int], str, tuple[ImageInput, ...]]:
        """A row with image parts or an image column, through the model's image pipeline
        (connectors/image_rows.py); RowError naming the problem."""
        chat = self._chat_options(row)
        return prompt_with_images(
            self.images, lambda v: encode_prompt(v, self.tokenizer, column, False, chat),
            column, value, images, chat, self.apply_chat_template)

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
        return with_row_structured(params, row) if row else params

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


def with_row_structured(params: SamplingParams, row: Mapping[str, Any]) -> SamplingParams:
    """`params` with the row's own `structured_outputs` / `response_format` column, if any;
    RowError naming the column otherwise."""
    try:
        given, spec = row_extras.structured_override(
            {k: to_python(row.get(k)) for k in row_extras.ROW_FIELDS[:2]})
        return replace(params, structured_outputs=spec) if given else params
    except (TypeError, ValueError) as e:
        raise RowError(f"bad structured output: {e}") from None


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
