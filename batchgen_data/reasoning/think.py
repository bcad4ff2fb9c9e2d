"""Reasoning parsers of the `<think>` families: the reasoning and the answer of one output apart.

DeepSeek-R1 (`deepseek_r1`) and Qwen3 (`qwen3`) write their reasoning between `<think>` and
`</think>`. Their chat templates differ in who writes the opening tag: R1's template ends the
prompt with `<think>` (the model only closes it), Qwen3's first release lets the model open
it, and Qwen3 with `enable_thinking=False` (a chat template kwarg, per row) writes an empty
`<think></think>` into the prompt so the model answers at once. So where an output starts is
read from the prompt's tokens: the last think tag of the prompt says whether the row starts
inside the reasoning (`<think>`), outside it (`</think>`: thinking switched off), or neither
(the parser's own assumption: both families assume thinking). That works the same for a
`messages` row rendered here and for a prompt given as token ids.

The text split follows vLLM's parsers (their test cases are tests/unit/reasoning's oracle):
an opening tag in the output is dropped with what precedes it; no closing tag means the
output is all reasoning (a row cut by `max_tokens` while thinking keeps its reasoning and has
an empty answer); text after the closing tag is the answer. The tags are located in the
decoded text, as vLLM does, so they must survive detokenisation: both families register them
as added tokens that are not special. The token counts use the tags' ids.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

# Qwen's documented way to end thinking early; the closing tag makes the model answer next
DEFAULT_END_STR = ("\n\nConsidering the limited time by the user, I have to give the solution "
                   "based on the thinking directly now.\n</think>\n\n")


@dataclass(frozen=True)
class Reasoned:
    """One output split: `reasoning` (None: the row did not think), `content` (the answer,
    '' when there is none) and how many output tokens the reasoning took (tags left out)."""

    reasoning: str | None
    content: str
    num_reasoning_tokens: int


class ThinkParser:
    """The `<think>...</think>` family; subclasses name themselves and may refine `split`."""

    name: ClassVar[str] = ""
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    def __init__(self, tokenizer: Any, end_str: str | None = None) -> None:
        """Resolves the tags to token ids (ValueError naming the parser when the tokenizer
        lacks them) and `end_str`, the text a thinking budget appends (None: Qwen's
        sentence), to the ids that will be appended; it must hold the closing tag."""
        vocab = tokenizer.get_vocab()
        missing = [t for t in (self.start, self.end) if t not in vocab]
        if missing:
            raise ValueError(f"reasoning_parser={self.name!r}: the tokenizer has no {missing} "
                             "token(s); this model does not write its reasoning that way")
        self.start_id: int = vocab[self.start]
        self.end_id: int = vocab[self.end]
        self.end_str = DEFAULT_END_STR if end_str is None else end_str
        if not isinstance(self.end_str, str) or self.end not in self.end_str:
            raise ValueError(f"reasoning_end_str={end_str!r}: must be text that contains "
                             f"{self.end!r}, which ends the reasoning")
        self.end_ids: list[int] = list(tokenizer.encode(self.end_str, add_special_tokens=False))

    def prompt_thinking(self, prompt_ids: Sequence[int]) -> bool | None:
        """Whether the prompt leaves the model inside its reasoning (True), after it (False:
        thinking switched off by the template) or says nothing (None)."""
        start, end = self.start_id, self.end_id
        for t in reversed(prompt_ids):
            if t == end:
                return False
            if t == start:
                return True
        return None

    def split(self, text: str, thinking: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of an output text in vLLM's terms: None where a part is
        absent. `thinking=False`: the row's thinking was switched off, all is content."""
        if not thinking:
            return None, text
        head, tag, tail = text.partition(self.start)
        body = tail if tag else head
        reasoning, tag, content = body.partition(self.end)
        if not tag:
            return body, None
        return reasoning, content or None

    def count_reasoning(self, output_ids: Sequence[int], thinking: bool) -> int:
        """Output tokens inside the reasoning (tags left out), `thinking` at the start; an
        opening tag drops what came before it, as the text split does."""
        # list.index scans in C and copies nothing: this runs once per finished sample
        ids = output_ids if isinstance(output_ids, list) else list(output_ids)
        start, begin = self.start_id, 0
        if not thinking:  # only an opening tag in the output starts a reasoning
            if start not in ids:
                return 0
            begin = ids.index(start) + 1
        try:
            stop = ids.index(self.end_id, begin)
        except ValueError:
            stop = len(ids)
        while True:  # the last opening tag before the end starts the reasoning
            try:
                begin = ids.index(start, begin, stop) + 1
            except ValueError:
                return stop - begin

    def parse(self, prompt_ids: Sequence[int], output_ids: Sequence[int], text: str
              ) -> Reasoned:
        """The split of one finished sample (`text`: its output as the user sees it)."""
        state = self.prompt_thinking(prompt_ids)
        reasoning, content = self.split(text, state is not False)
        return Reasoned(reasoning, content or "",
                        self.count_reasoning(output_ids, state is not False))


class DeepSeekR1Parser(ThinkParser):
    """DeepSeek-R1 (and its distills): the template opens `<think>`, the model closes it."""

    name = "deepseek_r1"


class Qwen3Parser(ThinkParser):
    """Qwen3: thinking on by default, off per row with `enable_thinking=False`; a tool call
    that starts before any `</think>` ends the reasoning there (vLLM's rule)."""

    name = "qwen3"
    tool_call: ClassVar[str] = "<tool_call>"

    def split(self, text: str, thinking: bool = True) -> tuple[str | None, str | None]:
        if thinking and self.end not in text and self.tool_call in text:
            head, tag, tail = text.partition(self.start)
            body = tail if tag else head
            at = body.index(self.tool_call)
            return body[:at], body[at:]
        return super().split(text, thinking)
