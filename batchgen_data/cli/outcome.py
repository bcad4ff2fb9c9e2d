"""What a runner hands back for each work item, whichever runner ran it."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchgen_data.cli.inputs import WorkItem
from batchgen_data.openai.batch_output import Choice
from batchgen_data.report.record import RunRecord


@dataclass
class Outcome:
    item: WorkItem
    choices: list[Choice] = field(default_factory=list)  # empty when the item failed
    prompt_tokens: int = 0
    error: str | None = None
    error_code: str | None = None
    actor: str = "local"

    @property
    def generated_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


Emit = Callable[[Outcome], None]


class Runner(Protocol):
    """Runs work items and calls `emit` once per item, as each finishes (any order)."""

    record: RunRecord

    def run(self, items: Iterable[WorkItem], emit: Emit) -> None: ...

    def token_text(self, token_id: int) -> str: ...


def outcome_from_row(item: WorkItem, row: dict[str, Any], actor: str,
                     num_top: int = 0) -> Outcome:
    """An Outcome from a connector output row (Ray, Spark): its choices, or its error.

    The row's `samples` column holds every sample when n > 1 (connectors/row_extras.py); its
    `logprobs` / `top_logprobs` columns hold the first sample's logprobs and, with `num_top`
    (the request's top count), the alternatives at each position.
    """
    if row.get("error") is not None:
        return Outcome(item, error=str(row["error"]), error_code="invalid_request", actor=actor)
    first = Choice(row.get("generated_text") or "", list(row.get("generated_token_ids") or ()),
                   row.get("finish_reason"),
                   _position_logprobs(row.get("generated_token_ids"), row.get("logprobs"),
                                      row.get("top_logprobs")), num_top,
                   row.get("reasoning_text"), _count(row.get("num_reasoning_tokens")),
                   row.get("tool_calls"))
    samples = row.get("samples")
    if not samples:
        return Outcome(item, [first], int(row.get("num_prompt_tokens") or 0), actor=actor)
    choices = [Choice(s.get("text") or "", list(s.get("token_ids") or ()), s.get("finish_reason"),
                      _position_logprobs(s.get("token_ids"), s.get("logprobs"), None))
               for s in samples]
    choices[0] = first  # the same sample, with its top alternatives when asked for
    return Outcome(item, choices, int(row.get("num_prompt_tokens") or 0), actor=actor)


def _count(value: Any) -> int | None:
    return None if value is None else int(value)


def _position_logprobs(token_ids: Any, sampled: Any, top: Any
                       ) -> list[dict[int, float]] | None:
    """Per generated token, {token_id: logprob}: the sampled token's, plus the top candidates
    where the row has them; None when the request asked for no logprobs."""
    if sampled is None or token_ids is None:
        return None
    out = [{int(t): float(lp)} for t, lp in zip(token_ids, sampled)]
    for d, entries in zip(out, top or ()):
        for e in entries or ():
            d.setdefault(int(e["token_id"]), float(e["logprob"]))
    return out
