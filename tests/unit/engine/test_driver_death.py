"""EngineDriver: every Future learns that the engine died, a request still in the inbox
included (its Future is the one the caller holds, not a placeholder), and a post that comes
after the death raises at once instead of waiting in an inbox nobody drains."""
from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from batchgen_data.engine.driver import EngineDeadError, EngineDriver
from batchgen_data.sampling_params import SamplingParams


class _DyingEngine:
    """A fake engine whose first step raises once `go` is set; requests submitted before that
    are live, so the loop steps."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.stepping = threading.Event()
        self.live: list[str] = []

    def check_request(self, ids, params) -> None:  # noqa: ANN001
        pass

    def check_lora(self, lora) -> None:  # noqa: ANN001
        pass

    def submit(self, ids, params, request_id=None, **kw) -> str:  # noqa: ANN001, ANN003
        rid = request_id or f"r{len(self.live)}"
        self.live.append(rid)
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def step(self) -> list:
        self.stepping.set()
        self.go.wait(10)
        raise RuntimeError("device lost")


def test_every_future_fails_when_the_loop_dies() -> None:
    engine = _DyingEngine()
    driver = EngineDriver(engine)  # type: ignore[arg-type]
    try:
        first = driver.submit([1, 2], SamplingParams())
        assert engine.stepping.wait(10)
        # the loop is now inside step(): these wait in the inbox when it dies
        waiting = [driver.submit([3], SamplingParams()) for _ in range(3)]
        call: Future = driver.call(lambda e: 42)
        engine.go.set()
        for fut in [first, *waiting, call]:
            with pytest.raises(EngineDeadError, match="device lost"):
                fut.result(timeout=10)
        with pytest.raises(EngineDeadError):
            driver.submit([4], SamplingParams())
        assert driver.num_in_flight() == len(driver._futures)  # noqa: SLF001 - the inbox is empty
    finally:
        engine.go.set()
        driver.shutdown()
