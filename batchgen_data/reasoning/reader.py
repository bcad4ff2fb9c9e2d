"""How an engine reads a finished output: its reasoning apart, then the tool calls in its
answer. Built once per engine from its `reasoning_parser` and `tool_call_parser`
(`OutputReader.of`), applied when a request finishes (core/request.py)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batchgen_data.reasoning.registry import reasoning_parser
from batchgen_data.reasoning.think import ThinkParser
from batchgen_data.reasoning.tools import ToolCalls, tool_parser


@dataclass(frozen=True)
class Read:
    """One sample as read: `text` is what the user is answered (the answer, without the
    reasoning and the calls); the other fields are None where no parser asked for them."""

    text: str
    reasoning: str | None = None
    num_reasoning_tokens: int | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_error: str | None = None


@dataclass(frozen=True)
class OutputReader:
    reasoning: ThinkParser | None = None
    tools: Callable[[str], ToolCalls] | None = None

    @classmethod
    def of(cls, tokenizer: Any, reasoning_name: str | None, end_str: str | None,
           tools_name: str | None) -> "OutputReader | None":
        """The engine's reader, None when it has neither parser (outputs as they are)."""
        if reasoning_name is None and tools_name is None:
            return None
        return cls(None if reasoning_name is None else
                   reasoning_parser(reasoning_name, tokenizer, end_str),
                   None if tools_name is None else tool_parser(tools_name))

    def read(self, prompt_ids: Sequence[int], output_ids: Sequence[int], text: str) -> Read:
        thought = n = None
        if self.reasoning is not None:
            split = self.reasoning.parse(prompt_ids, output_ids, text)
            text, thought, n = split.content, split.reasoning, split.num_reasoning_tokens
        if self.tools is None:
            return Read(text, thought, n)
        found = self.tools(text)
        if not found.calls:
            return Read(text, thought, n, None, found.error)
        return Read(found.content or "", thought, n, found.calls, found.error)
