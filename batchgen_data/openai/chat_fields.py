"""The chat body fields of reasoning models and tools: what the chat template receives
(`chat_template_kwargs`, `tools` under `tool_choice`) and `reasoning_effort` as a thinking
budget. docs/reasoning.md says what each does."""
from __future__ import annotations

from typing import Any

# `reasoning_effort` as a thinking budget in tokens (SamplingParams.thinking_token_budget; the
# engine needs a reasoning_parser): "none" ends the thinking at once
REASONING_EFFORT_BUDGETS = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096,
                            "high": 16384}


class Unsupported(ValueError):
    """A value this engine cannot honour yet (the line's `unsupported_field` error)."""


def template_kwargs(body: dict[str, Any], chat: bool) -> dict[str, Any] | None:
    """What a line's chat template receives: its `chat_template_kwargs` (vLLM's extra) and
    its `tools`; None when nothing. ValueError (Unsupported) naming the field otherwise."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be an object")
    tools = _tools(body)
    if (kwargs or tools) and not chat:
        raise ValueError("chat_template_kwargs / tools: /v1/completions renders no chat "
                         "template")
    if tools is not None:  # rendered by the chat template's own tool support
        kwargs = {**(kwargs or {}), "tools": tools}
    return kwargs or None


def _tools(body: dict[str, Any]) -> list[Any] | None:
    """`tools` for the template, or None: `tool_choice` "none" renders none; "auto" (the
    default) lets the model choose; forcing a call is not supported yet."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, dict) for t in tools)):
        raise ValueError("tools must be a list of objects")
    if choice not in (None, "none", "auto"):
        raise Unsupported(f"tools with tool_choice={choice!r}: only 'auto' and 'none' are "
                          "supported (a call cannot be forced yet)")
    return tools if tools and choice != "none" else None


def effort_budget(body: dict[str, Any]) -> int | None:
    """The thinking budget a line's `reasoning_effort` asks for (None: no budget)."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return None
    if effort not in REASONING_EFFORT_BUDGETS:
        raise ValueError(f"reasoning_effort={effort!r}: use one of "
                         f"{list(REASONING_EFFORT_BUDGETS)}")
    return REASONING_EFFORT_BUDGETS[effort]
