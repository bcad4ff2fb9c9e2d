"""A fake at the predictor's seam (`BatchGenPredictor.start_driver`) for the migration tests: an
engine that runs no step while a gate is closed, so a test can force a move instead of racing
the clock. The product has no such option; the tests build it from the driver and the engine's
public surface. (A plain module, not a conftest: Ray ships it to the actors by value.)"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from batchgen_data.connectors.ray_data import BatchGenPredictor
from batchgen_data.connectors.ray.predictor import default_device_kwargs
from batchgen_data.engine.driver import EngineDriver
from batchgen_data.engine.engine import Engine


class GatedEngine:
    """`engine` as the driver sees it, but with no unfinished work while `gate()` is False (the
    driver then serves its calls, imports and exports included, and runs no step); counts the
    steps it ran."""

    def __init__(self, engine: Engine, gate: Callable[[], bool]) -> None:
        self._engine, self._gate = engine, gate
        self.steps = 0

    def has_unfinished(self) -> bool:
        return self._engine.has_unfinished() and self._gate()

    def step(self) -> Any:
        self.steps += 1
        return self._engine.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class HoldingPredictor(BatchGenPredictor):
    """`BatchGenPredictor` whose engine, after `hold_for_move_after` steps, runs no further step
    until this predictor has exported or imported a row (or `timeout_s` has passed); 0 holds
    before the first step (waiting rows move), a few steps in, running rows move. `frozen`: it
    never steps (its guests stay unfinished). -1 and not frozen: the plain predictor."""

    def __init__(self, *args: Any, hold_for_move_after: int = -1, frozen: bool = False,
                 timeout_s: float = 600.0, **kwargs: Any) -> None:
        self.hold_after, self.frozen = hold_for_move_after, frozen
        self.deadline = time.monotonic() + timeout_s
        super().__init__(*args, **kwargs)

    def gate(self) -> bool:
        if self.frozen:
            return False
        if self.hold_after < 0:
            return True
        m = getattr(self, "migration", None)
        moved = m is not None and (m.counts["exported"] or m.counts["imported"])
        return bool(moved) or self.gated.steps < self.hold_after or \
            time.monotonic() > self.deadline

    def start_driver(self, model: str | None, engine_kwargs: dict[str, Any]) -> Any:
        self.gated = GatedEngine(
            Engine.from_kwargs(model, **default_device_kwargs(engine_kwargs)), self.gate)
        return EngineDriver(self.gated)  # type: ignore[arg-type]


class PredictorHost:
    """A plain threaded actor around one (holding) predictor, so a test can pick and kill the
    importer, keep a call open on it (only engines with a task in flight take work) and read
    its counters."""

    def __init__(self, hold_for_move_after: int = -1, frozen: bool = False,
                 **kwargs: Any) -> None:
        import threading

        self.predictor = HoldingPredictor(hold_for_move_after=hold_for_move_after,
                                          frozen=frozen, **kwargs)
        self.released = threading.Event()

    def busy(self) -> bool:
        """Stand in for a task in flight (only such engines take work) until `release`."""
        self.predictor.migration.enter_call()
        self.released.wait(120)
        self.predictor.migration.leave_call()  # returns once the guests are finished
        return True

    def active_calls(self) -> int:
        return self.predictor.migration.active_calls

    def release(self) -> None:
        self.released.set()

    def run(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        import pyarrow as pa

        return [r for t in self.predictor(pa.Table.from_pylist(rows)) for r in t.to_pylist()]

    def counts(self) -> dict[str, Any]:
        m = self.predictor.migration
        return {**m.counts, "disabled": m.disabled,
                "computed_tokens": self.predictor.driver.engine.stats.computed_tokens}
