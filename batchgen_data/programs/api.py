"""The user-facing names of per-row programs: `program`, `Generate`, `GenerateResult`.

A program is a generator function of one row. It yields a `Generate` (or a list of them, run
side by side), receives the finished generation(s) as `GenerateResult`s, may branch or loop on
them, and returns a dict of output columns:

    @program
    def revise(row):
        draft = yield Generate(messages=[{"role": "user", "content": row["question"]}])
        final = yield Generate(messages=draft.conversation + [{"role": "user", "content": "Revise."}])
        return {"answer": final.text, "draft": draft.text}

This is SGLang's `@sgl.function` idea in plain Python: no tracing, no DSL, so any control flow
works. The runtime (`programs/run.py`) never pickles the generator; a program's state is its row
plus the results it has received, which is what lets it be replayed on another engine.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import pyarrow as pa

from batchgen_data.sampling_params import SamplingParams

SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
DEFAULT_MAX_STEPS = 16


class Generate:
    """One generation a program asks for: a prompt plus `SamplingParams` fields.

    Exactly one of `prompt` (sent as written, as `LLM.generate` does), `prompt_token_ids` or
    `messages` (through the chat template, as `LLM.chat` does). Sampling fields left out take
    the defaults of the run (`LLM.run(sampling_params=)`, a connector's `sampling_params`).
    """

    __slots__ = ("prompt", "prompt_token_ids", "messages", "sampling")

    def __init__(self, prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
                 messages: list[dict[str, Any]] | None = None, **sampling: Any) -> None:
        given = [n for n, v in (("prompt", prompt), ("prompt_token_ids", prompt_token_ids),
                                ("messages", messages)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"Generate needs exactly one of prompt, prompt_token_ids, messages; "
                             f"got {given or 'none'}")
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids) if prompt_token_ids is not None else None
        self.messages = [dict(m) for m in messages] if messages is not None else None
        self.sampling = {k: v for k, v in sampling.items() if v is not None}
        params = SamplingParams.from_dict(dict(self.sampling))  # names the bad field now
        if params.n != 1:
            raise ValueError(f"Generate(n={params.n}): yield a list of Generates to sample "
                             "several answers (each gets its own result)")

    def params(self, defaults: SamplingParams | None = None) -> SamplingParams:
        """The run's defaults with this step's fields on top."""
        return (defaults or SamplingParams()).merged(self.sampling)

    def __getattr__(self, name: str) -> Any:
        # Generate(max_tokens=8).max_tokens reads like a SamplingParams field
        if name in SAMPLING_FIELDS:
            return self.sampling.get(name, getattr(SamplingParams(), name))
        raise AttributeError(f"'Generate' object has no attribute {name!r}")

    def __repr__(self) -> str:
        what = next(f"{n}={getattr(self, n)!r}" for n in self.__slots__[:3]
                    if getattr(self, n) is not None)
        extra = "".join(f", {k}={v!r}" for k, v in self.sampling.items())
        return f"Generate({what}{extra})"


@dataclass(frozen=True)
class GenerateResult:
    """A finished generation, as a program receives it."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"
    prompt_token_ids: list[int]
    # the messages sent plus the reply as an assistant turn (a plain prompt: one user turn)
    conversation: list[dict[str, Any]] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose KV was reused, not computed
    logprobs: list[dict[int, float]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GenerateResult":
        return cls(**d)


ProgramFn = Callable[[dict[str, Any]], Generator[Any, Any, Any]]


class Program:
    """A program function plus its limits and declared output columns (see `program`)."""

    def __init__(self, fn: ProgramFn, max_steps: int = DEFAULT_MAX_STEPS,
                 schema: pa.Schema | Mapping[str, Any] | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"program needs a generator function, got {type(fn).__name__}")
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps={max_steps!r}: must be an int >= 1")
        self.fn = fn
        self.name = getattr(fn, "__name__", "program")
        self.max_steps = max_steps
        self.schema = as_schema(schema) if schema is not None else None
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __call__(self, row: dict[str, Any]) -> Generator[Any, Any, Any]:
        return self.fn(row)

    def __repr__(self) -> str:
        return f"<program {self.name} max_steps={self.max_steps}>"


def program(fn: ProgramFn | None = None, *, max_steps: int = DEFAULT_MAX_STEPS,
            schema: pa.Schema | Mapping[str, Any] | None = None) -> Any:
    """Decorator: `@program` or `@program(max_steps=8, schema={"answer": "string"})`.

    `max_steps` bounds the yields of one row (a runaway loop becomes a row error); `schema`
    declares the output columns, which Spark needs up front (Arrow types or type names).
    """
    if fn is None:
        return lambda f: Program(f, max_steps, schema)
    return Program(fn, max_steps, schema)


_TYPE_NAMES = {"string": pa.string(), "str": pa.string(), "int": pa.int64(),
               "int64": pa.int64(), "int32": pa.int32(), "float": pa.float64(),
               "double": pa.float64(), "float64": pa.float64(), "bool": pa.bool_(),
               "boolean": pa.bool_()}


def as_schema(schema: pa.Schema | Mapping[str, Any]) -> pa.Schema:
    """A pyarrow schema from one, or from {column: pa.DataType | type name | "list<name>"}."""
    if isinstance(schema, pa.Schema):
        return schema
    if not isinstance(schema, Mapping):
        raise TypeError(f"schema must be a pyarrow.Schema or a dict, got {type(schema).__name__}")
    return pa.schema([pa.field(name, _arrow_type(name, t)) for name, t in schema.items()])


def _arrow_type(column: str, t: Any) -> pa.DataType:
    if isinstance(t, pa.DataType):
        return t
    if isinstance(t, str):
        name = t.strip().lower()
        if name.startswith("list<") and name.endswith(">"):
            return pa.list_(_arrow_type(column, name[5:-1]))
        if name in _TYPE_NAMES:
            return _TYPE_NAMES[name]
    raise ValueError(f"schema[{column!r}] = {t!r}: use a pyarrow type or one of "
                     f"{sorted(_TYPE_NAMES)} (or list<name>)")
