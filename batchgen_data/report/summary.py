"""What a batch job did, from its output rows: the summary the examples and commands print.

The input is the connectors' output (a pyarrow Table or row dicts with `generated_text`,
`num_prompt_tokens`, `num_generated_tokens`, `finish_reason` and `error`), so the same numbers
come out whether the rows came from Ray Data, Spark or `LLM.generate` turned into rows.

Empty generations are counted on their own: a good row (no `error`) whose text is blank is the
failure a user does not see in an error count — an instruct model sent a raw prompt often ends at
once — so the summary always shows it.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

_COLUMNS = ("generated_text", "num_prompt_tokens", "num_generated_tokens", "finish_reason",
            "error")


_LOCATION = re.compile(r"^\s*(?:line \d+|prompts\[\d+\]|rows\[\d+\]):\s*")


def error_kind(message: str) -> str:
    """A row error's message without its particulars, so that like errors count together.

    "prompt has 12581 tokens; max_model_len is 2048" and "messages[0] needs ..." keep their
    first clause, with numbers as N: "prompt has N tokens", "messages[N] needs ...". A leading
    location ("line 7: ", the command's input line; "prompts[3]: ", LLM.generate's index) says
    where, not what, so it is dropped first.
    """
    message = _LOCATION.sub("", message, count=1)
    head = re.split(r"[:;]", message, maxsplit=1)[0].strip()
    return re.sub(r"\d+", "N", head)[:80] or "(no message)"


@dataclass(frozen=True)
class JobReport:
    """Counts over one job's output rows; `wall_s` is the caller's measurement, if any."""

    rows: int
    errors: dict[str, int] = field(default_factory=dict)  # error kind -> rows
    empty: int = 0  # good rows whose generated_text is blank
    finish_reasons: dict[str, int] = field(default_factory=dict)  # over good rows
    prompt_tokens: int = 0
    generated_tokens: int = 0
    wall_s: float | None = None
    error_examples: tuple[str, ...] = ()  # a few distinct messages, one per kind

    @property
    def error_rows(self) -> int:
        return sum(self.errors.values())

    @property
    def good_rows(self) -> int:
        return self.rows - self.error_rows

    @property
    def empty_fraction(self) -> float:
        return self.empty / self.good_rows if self.good_rows else 0.0

    @property
    def rows_per_s(self) -> float | None:
        return self.rows / self.wall_s if self.wall_s else None

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens per second of wall time."""
        return self.generated_tokens / self.wall_s if self.wall_s else None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values, derived figures included."""
        d = asdict(self)
        d["error_examples"] = list(self.error_examples)
        d.update(error_rows=self.error_rows, good_rows=self.good_rows,
                 rows_per_s=_round(self.rows_per_s), tokens_per_s=_round(self.tokens_per_s))
        return d

    def format(self) -> str:
        """A few aligned lines for a terminal or a notebook cell."""
        lines = [f"rows            {self.rows} ({self.good_rows} good, {self.error_rows} errors)"]
        for kind, count in sorted(self.errors.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  error  {count:>5}  {kind}")
        lines.append(f"empty           {self.empty} of {self.good_rows} good rows "
                     f"({100 * self.empty_fraction:.1f}%) have blank generated_text")
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.finish_reasons.items()))
        lines.append(f"finish reasons  {reasons or '-'}")
        lines.append(f"tokens          {self.prompt_tokens} prompt, "
                     f"{self.generated_tokens} generated")
        if self.wall_s is not None:
            lines.append(f"wall time       {self.wall_s:.1f} s, {_round(self.rows_per_s)} rows/s, "
                         f"{_round(self.tokens_per_s)} generated tokens/s")
        return "\n".join(lines)


def summarize(rows: pa.Table | Iterable[Mapping[str, Any]],
              wall_s: float | None = None) -> JobReport:
    """The JobReport of a job's output rows (a pyarrow Table or an iterable of row dicts)."""
    if isinstance(rows, pa.Table):
        missing = [c for c in _COLUMNS if c not in rows.column_names]
        if missing:
            raise ValueError(f"not a connector output table: missing columns {missing}")
        rows = rows.select(list(_COLUMNS)).to_pylist()
    total = empty = prompt_tokens = generated_tokens = 0
    errors: Counter[str] = Counter()
    examples: dict[str, str] = {}
    reasons: Counter[str] = Counter()
    for row in rows:
        total += 1
        message = row.get("error")
        if message is not None:
            kind = error_kind(str(message))
            errors[kind] += 1
            examples.setdefault(kind, str(message))
            continue
        if not (row.get("generated_text") or "").strip():
            empty += 1
        reasons[str(row.get("finish_reason"))] += 1
        prompt_tokens += int(row.get("num_prompt_tokens") or 0)
        generated_tokens += int(row.get("num_generated_tokens") or 0)
    return JobReport(rows=total, errors=dict(errors), empty=empty, finish_reasons=dict(reasons),
                     prompt_tokens=prompt_tokens, generated_tokens=generated_tokens,
                     wall_s=wall_s, error_examples=tuple(examples.values()))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
