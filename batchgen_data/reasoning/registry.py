"""Reasoning parsers by name, as vLLM's `reasoning_parser` names them.

One table, so the engine argument, the connectors' configs and the command's flag accept the
same names, and a wrong one is refused with the list of valid ones before a model loads.
"""
from __future__ import annotations

from typing import Any

from batchgen_data.reasoning.think import DeepSeekR1Parser, Qwen3Parser, ThinkParser

REASONING_PARSERS: dict[str, type[ThinkParser]] = {
    DeepSeekR1Parser.name: DeepSeekR1Parser,
    Qwen3Parser.name: Qwen3Parser,
}


def check_reasoning_parser(name: Any) -> None:
    """ValueError naming `reasoning_parser` and the valid names unless `name` is one (or None)."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r}: unknown; valid: "
                         f"{sorted(REASONING_PARSERS)} (docs/reasoning.md)")


def reasoning_parser(name: str, tokenizer: Any, end_str: str | None = None) -> ThinkParser:
    """The parser `name` over this tokenizer; `end_str`: what a thinking budget appends."""
    check_reasoning_parser(name)
    return REASONING_PARSERS[name](tokenizer, end_str)
