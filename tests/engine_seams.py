"""Fakes and spies at the engine's seams for tests (the product has no hooks for them).

`watch_steps` notes the shape of every step an engine schedules, by wrapping its scheduler's
`schedule` for the test's duration; `step_until_decode` / `schedule_decode` drive an engine to
a pure decode step (where runner and fast-path tests start), through its public surface only.
"""
from __future__ import annotations

from typing import Any

import pytest

from batchgen_data.core.scheduler_output import SchedulerOutput
from batchgen_data.engine.stats import StepShape


def watch_steps(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[StepShape]:
    """The shapes of the steps `engine` schedules from now on, in order (empty schedules
    too), taken as the scheduler hands each over."""
    shapes: list[StepShape] = []
    schedule = engine.scheduler.schedule

    def noted() -> SchedulerOutput:
        out = schedule()
        shapes.append(StepShape.of(out))
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", noted)
    return shapes


def step_until_decode(engine: Any) -> None:
    """Step until sequences run and each has exactly one token pending: the next step is a
    pure decode."""
    while not engine.scheduler.running or any(
            s.num_pending_tokens != 1 for s in engine.scheduler.running):
        if not engine.has_unfinished():
            raise RuntimeError("step_until_decode: no unfinished request to decode")
        engine.step()


def schedule_decode(engine: Any) -> SchedulerOutput:
    """`step_until_decode`, then the next step scheduled without running it, for a test that
    drives the runner itself; a later `step()` schedules the same batch again."""
    step_until_decode(engine)
    return engine.scheduler.schedule()


def triton_llm(model: str, **engine_kwargs: Any) -> Any:
    """An `LLM` whose layers are built for the Triton kernels whatever the device (on CPU
    tensors they run under TRITON_INTERPRET=1): the engine's parts built with `triton=True`."""
    from batchgen_data import LLM
    from batchgen_data.config import make_engine_config
    from batchgen_data.engine.engine import Engine
    from batchgen_data.engine.setup import build_parts

    config = make_engine_config(model, **engine_kwargs)
    return LLM._over(Engine(config, build_parts(config, triton=True)))
