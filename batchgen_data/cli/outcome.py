"""What a runner hands back for each work item, whichever runner ran it."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchgen_data.cli.inputs import WorkItem
from batchgen_data.openai_batch_output import Choice
from batchgen_data.report_record import RunRecord


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


def outcome_from_row(item: WorkItem, row: dict[str, Any], actor: str) -> Outcome:
    """An Outcome from a connector output row (Ray, Spark): one choice, or its error."""
    if row.get("error") is not None:
        return Outcome(item, error=str(row["error"]), error_code="invalid_request", actor=actor)
    choice = Choice(row.get("generated_text") or "", list(row.get("generated_token_ids") or ()),
                    row.get("finish_reason"))
    return Outcome(item, [choice], int(row.get("num_prompt_tokens") or 0), actor=actor)
