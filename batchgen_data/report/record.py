"""What a run looked like over time: the raw material of the HTML report (`report.html`).

A `RunRecord` collects, from any number of engines ("actors"):
  * samples of each engine's load (waiting / running / held sequences, generated tokens so far),
    taken after engine steps at most every `interval_s` — `EngineSampler` is the step hook;
  * migration events (a request exported from or imported into an engine);
  * one entry per finished row: when, where, how many tokens, and its error kind if any.
Everything is plain data (tuples of numbers and strings), so an engine on a Ray actor or a Spark
executor can ship its part to the driver and `merge` it there.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from batchgen_data.report.summary import error_kind


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # seconds since the epoch
    actor: str
    waiting: int
    running: int
    held: int
    generated_tokens: int  # cumulative, on this actor's engine

    @property
    def active(self) -> int:
        return self.waiting + self.running + self.held


@dataclass(frozen=True, slots=True)
class Finished:
    t: float
    actor: str
    generated_tokens: int
    error: str | None  # error kind (`summary.error_kind`), None for a good row


@dataclass
class RunRecord:
    samples: list[Sample] = field(default_factory=list)
    migrations: list[tuple[float, str, str]] = field(default_factory=list)  # (t, actor, kind)
    finished: list[Finished] = field(default_factory=list)
    start: float = field(default_factory=time.time)
    end: float | None = None
    title: str = "batchgen_data run"

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # engine threads and the main thread add at once

    def add_sample(self, sample: Sample) -> None:
        with self._lock:
            self.samples.append(sample)

    def add_migration(self, t: float, actor: str, kind: str) -> None:
        with self._lock:
            self.migrations.append((t, actor, kind))

    def add_finished(self, actor: str, generated_tokens: int, error: str | None,
                     t: float | None = None) -> None:
        kind = None if error is None else error_kind(error)
        with self._lock:
            self.finished.append(Finished(time.time() if t is None else t, actor,
                                          generated_tokens, kind))

    def add_rows(self, rows: Any, actor: str = "job") -> None:
        """One finished entry per connector output row (a pyarrow Table or row dicts), for a
        job whose rows were not recorded as they finished: all are stamped now."""
        if hasattr(rows, "to_pylist"):
            rows = rows.to_pylist()
        for row in rows:
            self.add_finished(actor, int(row.get("num_generated_tokens") or 0), row.get("error"))

    def merge(self, part: dict[str, Any]) -> None:
        """Add a part shipped from another process (`to_part`)."""
        with self._lock:
            self.samples += [Sample(*s) for s in part.get("samples", ())]
            self.migrations += [tuple(m) for m in part.get("migrations", ())]  # type: ignore[misc]
            self.finished += [Finished(*f) for f in part.get("finished", ())]

    def to_part(self) -> dict[str, Any]:
        with self._lock:
            return {"samples": [tuple(_values(s)) for s in self.samples],
                    "migrations": list(self.migrations),
                    "finished": [tuple(_values(f)) for f in self.finished]}

    def drain(self) -> dict[str, Any]:
        """`to_part`, emptying the record: what an engine ships, once."""
        with self._lock:
            part = {"samples": [tuple(_values(s)) for s in self.samples],
                    "migrations": list(self.migrations),
                    "finished": [tuple(_values(f)) for f in self.finished]}
            self.samples, self.migrations, self.finished = [], [], []
        return part

    def actors(self) -> list[str]:
        return sorted({s.actor for s in self.samples} | {f.actor for f in self.finished})


def _values(obj: Any) -> list[Any]:
    return [getattr(obj, name) for name in obj.__slots__]


class EngineSampler:
    """Engine step hook (`EngineDriver.step_hooks`): one `Sample` per `interval_s` at most, and
    always the first one after a change between busy and idle, so idle time is exact."""

    def __init__(self, record: RunRecord, actor: str, interval_s: float = 0.2) -> None:
        self.record = record
        self.actor = actor
        self.interval_s = interval_s
        self._last_t = float("-inf")
        self._last_busy: bool | None = None

    def __call__(self, engine: Any) -> None:
        now = time.time()
        busy = engine.num_unfinished() > 0  # cheap; `load()` walks every live request
        if now - self._last_t < self.interval_s and busy == self._last_busy:
            return
        self._last_t, self._last_busy = now, busy
        load = engine.load()
        self.record.add_sample(Sample(now, self.actor, load.waiting, load.running, load.held,
                                      engine.stats.generated_tokens))
