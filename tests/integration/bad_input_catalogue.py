"""The catalogue of bad input (docs/row-errors.md): every kind, an example row and its message.

Shared by tests/integration/test_bad_input*.py (offline API, row lifecycle, Ray, Spark) and by
the table in docs/row-errors.md, which `render_table` writes and a test compares, so the
document cannot drift from what the code says. Refresh the table with
`python tests/integration/bad_input_catalogue.py`.

Messages hold `{vocab}`, `{max_model_len}`, `{roles}` and `{valid}` (the valid sampling field
names); `Bad.expected` fills them in for one engine.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from batchgen_data.inputs.chat import ROLES
from batchgen_data.sampling_params import SamplingParams

DOC = Path(__file__).resolve().parents[2] / "docs" / "row-errors.md"
START, END = "<!-- bad-input-table:start -->", "<!-- bad-input-table:end -->"
FINE = "fine prompt"  # the prompt of a row whose only fault is its sampling_params


@dataclass(frozen=True)
class Bad:
    """One kind of bad row.

    `column` is the input column holding `value` (`sampling_params` rows carry the JSON text
    of their overrides next to a fine prompt). `offline` says how `LLM` meets the same input:
    "generate" (LLM.generate raises the message after "prompts[i]: "), "chat" (LLM.chat
    raises it), "params" (SamplingParams.from_dict raises it after "bad sampling_params: ")
    or "" (no offline counterpart). `spark_column` is False where a Spark column, typed once,
    cannot hold this value next to good rows: then a whole column of that type is tried.
    """

    kind: str
    column: str
    value: Any
    message: str
    offline: str
    spark_column: bool = True

    def row(self) -> dict[str, Any]:
        if self.column == "sampling_params":
            return {"prompt": FINE, "sampling_params": self.value}
        return {self.column: self.value}

    def expected(self, vocab: int, max_model_len: int) -> str:
        valid = sorted(f.name for f in fields(SamplingParams))
        return self.message.format(vocab=vocab, max_model_len=max_model_len,
                                   roles=list(ROLES), valid=valid)


def _sp(kind: str, overrides: str, message: str, offline: str = "params") -> Bad:
    prefix = "bad sampling_params: " if offline == "params" else ""
    return Bad(kind, "sampling_params", overrides, prefix + message, offline)


TOO_LONG = "prompt has 100 tokens: the decoder prompt (length 100) is longer than the maximum " \
           "model length of {max_model_len} (max_model_len)"
CATALOGUE: list[Bad] = [
    Bad("null prompt", "prompt", None, "prompt is null", "generate"),
    Bad("empty prompt", "prompt", "", "prompt is empty: The decoder prompt cannot be empty",
        "generate"),
    Bad("whitespace prompt", "prompt", " \n\t",
        r"prompt is empty (whitespace only): ' \n\t'", "generate"),
    Bad("prompt of the wrong type", "prompt", 42, "prompt must be a string, got int: 42",
        "generate", spark_column=False),
    Bad("prompt over max_model_len", "prompt_token_ids", [5] * 100, TOO_LONG, "generate"),
    Bad("token id out of the vocabulary", "prompt_token_ids", [5, 6, 99999],
        "prompt_token_ids[2]=99999: Token id 99999 is out of vocabulary [0, {vocab})",
        "generate"),
    Bad("negative token id", "prompt_token_ids", [-1, 5],
        "prompt_token_ids[0]=-1: Token id -1 is out of vocabulary [0, {vocab})", "generate"),
    Bad("token ids of the wrong type", "prompt_token_ids", ["a", "b"],
        "prompt_token_ids[0] is not an int: 'a'", "generate", spark_column=False),
    Bad("empty token ids", "prompt_token_ids", [],
        "prompt_token_ids is empty: The decoder prompt cannot be empty", "generate"),
    Bad("message without a role", "messages", [{"role": None, "content": "hi"}],
        "messages[0] needs string 'role' and 'content': got {{'content': 'hi'}}", "chat"),
    Bad("message content not a string", "messages", [{"role": "user", "content": 5}],
        "messages[0] needs string 'role' and 'content': got {{'role': 'user', 'content': 5}}",
        "chat", spark_column=False),
    Bad("unknown message role", "messages", [{"role": "wizard", "content": "hi"}],
        "messages[0] has an unknown role: 'wizard'; use one of {roles}", "chat"),
    Bad("empty messages", "messages", [],
        "messages must be a non-empty list of {{'role': str, 'content': str}}, got []", "chat"),
    _sp("negative temperature", '{"temperature": -1}',
        "SamplingParams.temperature must be non-negative, got -1."),
    _sp("temperature NaN", '{"temperature": NaN}',
        "SamplingParams.temperature must be a finite number, got nan."),
    _sp("temperature above 2", '{"temperature": 2.5}',
        "SamplingParams.temperature must be in [0, 2], got 2.5."),
    _sp("temperature of the wrong type", '{"temperature": "hot"}',
        "SamplingParams.temperature must be a number, got str: 'hot'"),
    _sp("top_p above 1", '{"top_p": 1.5}', "SamplingParams.top_p must be in (0, 1], got 1.5."),
    _sp("max_tokens 0", '{"max_tokens": 0}', "SamplingParams.max_tokens must be at least 1, got 0."),
    _sp("greedy with n > 1", '{"temperature": 0, "n": 2}',
        "SamplingParams.n must be 1 when using greedy sampling, got 2."),
    _sp("unknown sampling field", '{"temprature": 0.5}',
        "unknown sampling parameter(s) ['temprature']; valid: {valid}"),
    _sp("stop of the wrong type", '{"stop": 5}', "SamplingParams.stop must be a list, got int: 5"),
    _sp("logprobs over max_logprobs", '{"logprobs": 100000}',
        "SamplingParams.logprobs=100000: Requested sample logprobs of 100000, which is greater "
        "than max allowed: 20 (the engine's max_logprobs)", offline="generate"),
    _sp("prompt_logprobs over max_logprobs", '{"prompt_logprobs": 100000}',
        "SamplingParams.prompt_logprobs=100000: Requested prompt logprobs of 100000, which is "
        "greater than max allowed: 20 (the engine's max_logprobs)", offline="generate"),
    _sp("seed beyond 64 bits", '{"seed": 18446744073709551616, "temperature": 0.8}',
        "SamplingParams.seed=18446744073709551616: must fit in 64 bits, in [-2**63, 2**64)",
        offline="generate"),
    _sp("repetition_penalty that underflows", '{"repetition_penalty": 1e-300, '
        '"temperature": 0.8}', "SamplingParams.repetition_penalty=1e-300: must be in "
        "[2**-64, 2**64], so that logits divided or multiplied by it stay finite in float32",
        offline="generate"),
    _sp("sampling_params not an object", "[1, 2]", "sampling_params must be a dict, got list",
        offline=""),
    _sp("sampling_params not JSON", "{temperature", "sampling_params is not valid JSON: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        offline=""),
]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "\\n")


def render_table() -> str:
    """The Markdown table of docs/row-errors.md, between its markers."""
    lines = ["| kind | input | `error` (row error; `on_error=\"raise\"`: the RowError) | "
             "offline API |", "|---|---|---|---|"]
    how = {"generate": "`LLM.generate` raises it, after `prompts[i]: `",
           "chat": "`LLM.chat` raises it",
           "params": "`SamplingParams(...)` raises it (no `bad sampling_params: `)",
           "": "none (a connector's column)"}
    for bad in CATALOGUE:
        value = bad.value if bad.column == "sampling_params" else json.dumps(bad.value)
        if isinstance(bad.value, list) and len(bad.value) > 8:
            value = f"{json.dumps(bad.value[:2])[:-1]}, ...] ({len(bad.value)} ids)"
        text = bad.message.format(vocab="{vocab}", max_model_len="{max_model_len}",
                                  roles=list(ROLES), valid="[the field names]")
        lines.append(f"| {bad.kind} | `{_cell(bad.column)}` = `{_cell(str(value))}` | "
                     f"{_cell(text)} | {how[bad.offline]} |")
    return "\n".join([START, *lines, END])


def doc_table(text: str) -> str | None:
    match = re.search(re.escape(START) + ".*?" + re.escape(END), text, flags=re.S)
    return match.group(0) if match else None


if __name__ == "__main__":
    text = DOC.read_text()
    old = doc_table(text)
    assert old is not None, f"{DOC} has no {START} ... {END} block"
    DOC.write_text(text.replace(old, render_table()))
    print(f"wrote {len(CATALOGUE)} kinds to {DOC}")
