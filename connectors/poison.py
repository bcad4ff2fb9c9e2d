"""The poison-row record: which rows an engine's deaths point at, and what a retry does with them.

An engine blames a row it can (engine/step_failure.py: the row errs, the engine runs on). When
it cannot, it dies, and its `EngineDeadError` names as `suspects` the requests of the step that
failed: one of them may have killed it, or nothing did (a lost device). A retry that sent those
rows again the same way could die the same death forever, so each connector keeps, per call
(Ray: one `__call__` of a task, across its attempts) or per task (Spark), a `PoisonBook` of the
deaths it saw and the suspect rows of each, and asks it before it submits a row again:

* a row that was a suspect at a death is **quarantined**: the retry runs it alone
  (`Engine.submit(alone=True)`: in steps with no other request), so that if it fails again the
  failure is its own and nothing else is lost with it;
* a row that was a suspect at `DEATHS` deaths, at least one of them while it ran alone, is
  **blamed**: the retry does not run it again and it becomes a row error (`poison_message`).

So a row is blamed only on evidence: the engine failed, and found no part of the step it could
run without the failure, with this row and no other in the step, and did so again. A row that
was merely in flight is never blamed, and a death with no suspects (the failure was outside a
step, or no part of the step failed again) changes nothing: the retry runs as before.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from batchgen_data.core.errors import EngineDeadError, StepError

DEATHS = 2  # suspect at this many deaths, alone at one: blamed


@dataclass(frozen=True)
class Death:
    """One engine death as one call (or task) saw it: its rows among the suspects, and
    whether the failed step held a single request."""

    rows: frozenset[Hashable]
    alone: bool


@dataclass
class Verdict:
    blamed: dict[Hashable, str] = field(default_factory=dict)  # row -> its row error
    quarantined: set[Hashable] = field(default_factory=set)  # rows to run alone


@dataclass
class PoisonBook:
    deaths: list[Death] = field(default_factory=list)

    def record(self, suspects: Iterable[Hashable], alone: bool) -> Death | None:
        """Note a death whose failed step held these of our rows (`alone`: and no other
        request); None when none of ours was in it."""
        rows = frozenset(suspects)
        if not rows:
            return None
        death = Death(rows, alone)
        self.deaths.append(death)
        return death

    def verdict(self) -> Verdict:
        out = Verdict()
        counts: dict[Hashable, int] = {}
        lone: set[Hashable] = set()
        for d in self.deaths:
            for row in d.rows:
                counts[row] = counts.get(row, 0) + 1
                if d.alone:
                    lone.add(row)
        for row, n in counts.items():
            if n >= DEATHS and row in lone:
                out.blamed[row] = poison_message(n)
            else:
                out.quarantined.add(row)
        return out


def poison_message(deaths: int) -> str:
    return (f"poison row: an engine died {deaths} times with this row in the step that failed "
            "(the last time alone in it), so it is not run again (docs/row-errors.md)")


def death_suspects(exc: BaseException | None, driver: Any) -> tuple[str, ...]:
    """The requests an engine death names: its `EngineDeadError`'s, else those of the error
    that ended the driver's loop (a `StepError`), else none."""
    for err in (exc, driver.dead):
        if isinstance(err, (EngineDeadError, StepError)) and err.suspects:
            return tuple(err.suspects)
    return ()
