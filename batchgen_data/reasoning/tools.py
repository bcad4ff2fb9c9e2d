"""Tool-call parsers: the calls a model wrote into its answer, in OpenAI's shape.

Chosen by vLLM's `tool_call_parser` names. Each turns an answer text into the text left for
the user (None when the answer was only calls) and a list of calls `{"id", "type":
"function", "function": {"name", "arguments"}}` with the arguments as JSON text. A call whose
body or arguments are not valid JSON is never a failed job: it is reported in `error` (the
row's `tool_call_error`) and the answer stays text, as vLLM leaves it. The formats:

- `hermes` (Hermes 2 Pro, Qwen2.5 / Qwen3): `<tool_call>{"name": .., "arguments": {..}}
  </tool_call>` blocks after optional text; the last block may be cut by EOS.
- `llama3_json` (Llama 3.1 / 3.2): JSON objects `{"name": .., "parameters": {..}}` in the
  answer, several separated by `;`, optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`, or (v11 tokenizers)
  `name{arguments}` after each `[TOOL_CALLS]`; ids of 9 letters and digits, as Mistral's
  templates require.
- `pythonic` (Llama 3.2 / 4, Granite): the answer is a Python list of calls with literal
  keyword arguments, `[get_weather(city='Paris'), now()]`.
"""
from __future__ import annotations

import ast
import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class ToolCalls:
    """What a parser found in one answer."""

    content: str | None  # the answer without its calls (None: nothing else was said)
    calls: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None  # a call that could not be read, said per row


def _call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    """One call in OpenAI's shape: arguments already JSON text stay as they are (Granite
    writes them so), anything else is serialised once."""
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
            text = arguments
        except json.JSONDecodeError:
            text = json.dumps(arguments, ensure_ascii=False)
    else:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}


def _named(obj: Any, *arg_keys: str) -> tuple[str, Any] | None:
    """(name, arguments) of a decoded call object, None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in arg_keys:
        if key in obj:
            return obj["name"], obj[key]
    return None


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.S)


def hermes(text: str) -> ToolCalls:
    at = text.find("<tool_call>")
    if at < 0:
        return ToolCalls(text)
    calls = []
    for i, m in enumerate(_HERMES.finditer(text)):
        body = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
        try:
            found = _named(json.loads(body), "arguments", "parameters")
        except json.JSONDecodeError as e:
            return ToolCalls(text, error=f"tool call {i}: not valid JSON ({e})")
        if found is None:
            return ToolCalls(text, error=f"tool call {i}: needs a 'name' and 'arguments'")
        calls.append(_call(*found))
    return ToolCalls(text[:at] or None, calls)


def llama3_json(text: str) -> ToolCalls:
    body = text.split("<|python_tag|>", 1)[-1]
    decoder = json.JSONDecoder()
    calls, i = [], body.find("{")
    while i >= 0:
        try:
            obj, end = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            i = body.find("{", i + 1)
            continue
        found = _named(obj, "parameters", "arguments")
        if found is not None:
            calls.append(_call(*found))
            i = body.find("{", end)
        else:
            i = body.find("{", i + 1)
    return ToolCalls(None, calls) if calls else ToolCalls(text)


def _mistral_id() -> str:
    return uuid.uuid4().hex[:9]


def mistral(text: str) -> ToolCalls:
    marker = "[TOOL_CALLS]"
    at = text.find(marker)
    if at < 0:
        return ToolCalls(text)
    content = text[:at] or None
    parts = [p.strip() for p in text[at:].split(marker) if p.strip()]
    calls = []
    try:
        for i, part in enumerate(parts):
            if part.startswith("["):  # the JSON list form
                items = json.loads(part)
                if not isinstance(items, list):
                    raise ValueError("not a list of calls")
                for item in items:
                    found = _named(item, "arguments", "parameters")
                    if found is None:
                        raise ValueError("needs a 'name' and 'arguments'")
                    calls.append(_call(*found, call_id=_mistral_id()))
            else:  # name{arguments}
                name, brace, args = part.partition("{")
                if not brace or not name.strip():
                    raise ValueError("needs name{arguments}")
                calls.append(_call(name.strip(), json.loads(brace + args),
                                   call_id=_mistral_id()))
    except (ValueError, json.JSONDecodeError) as e:
        return ToolCalls(text, error=f"tool call {len(calls)}: {e}")
    return ToolCalls(content, calls)


def _literal(node: ast.expr) -> Any:
    value = ast.literal_eval(node)
    json.dumps(value, allow_nan=False)  # bytes, sets, inf: not JSON
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


def pythonic(text: str) -> ToolCalls:
    stripped = text.strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        return ToolCalls(text)
    try:
        tree = ast.parse(stripped, mode="eval").body
    except SyntaxError as e:
        return ToolCalls(text, error=f"tool calls: not a Python list of calls ({e.msg})")
    if not isinstance(tree, ast.List) or not all(isinstance(c, ast.Call) for c in tree.elts):
        return ToolCalls(text)
    calls, errors = [], []
    for i, c in enumerate(tree.elts):
        try:
            if not isinstance(c.func, ast.Name) or c.args:
                raise ValueError("a call by name with keyword arguments only")
            calls.append(_call(c.func.id, {k.arg: _literal(k.value) for k in c.keywords}))
        except (ValueError, TypeError, SyntaxError) as e:
            errors.append(f"tool call {i}: {e}")
    if not calls:
        return ToolCalls(text, error="; ".join(errors) or None)
    return ToolCalls(None, calls, "; ".join(errors) or None)


TOOL_PARSERS: dict[str, Callable[[str], ToolCalls]] = {
    "hermes": hermes, "llama3_json": llama3_json, "mistral": mistral, "pythonic": pythonic}


def tool_parser(name: Any) -> Callable[[str], ToolCalls]:
    """The parser `name`; ValueError naming `tool_call_parser` and the valid names."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser={name!r}: unknown; valid: {sorted(TOOL_PARSERS)} "
                         "(docs/reasoning.md)")
    return TOOL_PARSERS[name]
