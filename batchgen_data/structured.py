"""What a request's output must look like: vLLM's `StructuredOutputsParams`, and OpenAI's
`response_format` mapped onto it.

Exactly one constraint is set per request: a JSON schema (`json`), any JSON object
(`json_object`), a regular expression (`regex`), one of a list of strings (`choice`), or a
context-free grammar in EBNF/GBNF (`grammar`, xgrammar's dialect: `root ::= ...`). This module
is plain data and imports no grammar engine, so drivers and connectors can validate rows cheaply;
`structured.grammars` compiles the constraint when an engine accepts the request.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


def json_text(text: str, what: str, error: type[Exception] = ValueError) -> Any:
    """`text` parsed as JSON; a parse failure raises `error` naming the field `what`.
    Shared by every column that takes either an object or its JSON text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{what} is not valid JSON: {e}") from None


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None  # a JSON schema (dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF / GBNF
    json_object: bool | None = None  # any JSON object (OpenAI's {"type": "json_object"})
    # JSON only: no whitespace between tokens of the JSON text (vLLM's field). Compact output
    # leaves a small model fewer ways to wander off into whitespace until max_tokens.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"structured_outputs: set exactly one of {list(KINDS)}, got "
                             f"{set_kinds or 'none'}")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            object.__setattr__(self, "json", parsed)
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json must be a JSON schema object (dict), got "
                             f"{type(self.json).__name__}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object={self.json_object!r}: must be a bool")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            choice = list(self.choice) if isinstance(self.choice, (list, tuple)) else None
            if not choice or any(not isinstance(c, str) or not c for c in choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            object.__setattr__(self, "choice", choice)
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """Hashable identity of the constraint: equal keys compile to the same grammar."""
        kind = self.kind
        value = getattr(self, kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return kind, text, self.disable_any_whitespace

    def to_dict(self) -> dict[str, Any]:
        """Only the fields that are set (what a connector or an export carries)."""
        out: dict[str, Any] = {self.kind: getattr(self, self.kind)}
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out

    @classmethod
    def from_value(cls, value: Any) -> "StructuredOutputsParams | None":
        """From a StructuredOutputsParams, a dict with its field names (None values ignored),
        its JSON text, or None. TypeError names unknown keys."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = json_text(value, "structured_outputs")
        if not isinstance(value, Mapping):
            raise TypeError("structured_outputs must be a StructuredOutputsParams or a dict, got "
                            f"{type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise TypeError(f"structured_outputs: unknown key(s) {unknown}; valid: {sorted(known)}")
        given = {k: v for k, v in value.items() if v is not None}
        if not given:
            return None
        return cls(**given)


def from_response_format(rf: Any) -> StructuredOutputsParams | None:
    """OpenAI's `response_format` as a constraint: `{"type": "text"}` → None,
    `{"type": "json_object"}` → any JSON object, `{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}}}` → that schema. A JSON string of one of these is accepted."""
    if rf is None:
        return None
    if isinstance(rf, str):
        rf = json_text(rf, "response_format")
    if not isinstance(rf, Mapping):
        raise ValueError(f"response_format must be an object, got {type(rf).__name__}")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if schema is None:
            raise ValueError('response_format: type "json_schema" needs '
                             '{"json_schema": {"name": ..., "schema": {...}}}')
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"response_format.type={kind!r}: use 'text', 'json_object' or 'json_schema'")
