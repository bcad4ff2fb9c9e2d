"""A real `EngineDriver` over a real tiny engine whose `step()` raises (as a CUDA error would),
driven through both connectors: the row Futures fail with `EngineDeadError`, the Ray actor
exits (its `os._exit` is recorded instead), and the Spark worker's engine cache forgets the
dead engine so that the next task builds a new one. No Ray or Spark cluster is started.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pytest

from batchgen_data import SamplingParams
from batchgen_data.connectors.ray import predictor as ray_predictor
from batchgen_data.connectors.spark import engine_cache as spark_engine_cache, task as spark_task
from batchgen_data.connectors.ray.predictor import BatchGenPredictor
from batchgen_data.connectors.spark.engine_cache import EngineCache, build_driver
from batchgen_data.connectors.spark.task import TaskSession, TaskSettings
from batchgen_data.engine.driver import EngineDeadError, EngineDriver
from batchgen_data.engine.engine import Engine

ENGINE = {"max_model_len": 128, "max_num_seqs": 4, "device": "cpu", "num_threads": 1}
CUDA_ERROR = "CUDA error: an illegal memory access was encountered"


def break_after(driver: EngineDriver, good_steps: int) -> EngineDriver:
    """Make the driver's engine raise from its `good_steps + 1`-th step on."""
    real = driver.engine.step
    count = [0]

    def step() -> Any:
        count[0] += 1
        if count[0] > good_steps:
            raise RuntimeError(CUDA_ERROR)
        return real()

    driver.engine.step = step  # type: ignore[method-assign]
    return driver


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[..., Path]) -> str:
    return str(tiny_model_dir("llama"))


def test_driver_fails_every_future_and_refuses_new_work(model: str) -> None:
    driver = break_after(EngineDriver(Engine.from_kwargs(model, **ENGINE)), good_steps=2)
    sp = SamplingParams(max_tokens=50, ignore_eos=True)
    futures = [driver.submit([5, 6, 7 + i], sp) for i in range(3)]
    for f in futures:
        with pytest.raises(EngineDeadError, match="illegal memory access"):
            f.result(timeout=60)
    assert isinstance(driver.dead, RuntimeError)
    with pytest.raises(EngineDeadError):
        driver.submit([5, 6], sp)
    with pytest.raises(EngineDeadError):
        driver.call(lambda e: e.has_unfinished())
    driver.shutdown()


def test_ray_predictor_task_fails_and_the_actor_exits(model: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    exits: list[int] = []
    monkeypatch.setattr(ray_predictor.os, "_exit", exits.append)

    class Breaks(BatchGenPredictor):
        def start_driver(self, m: str | None, kw: dict[str, Any]) -> EngineDriver:
            return break_after(EngineDriver(Engine.from_kwargs(m, **kw)), good_steps=1)

    pred = Breaks(model=model, sampling_params={"max_tokens": 40, "ignore_eos": True},
                  migration=False, apply_chat_template=False, **ENGINE)
    with pytest.raises(EngineDeadError):
        list(pred(pa.table({"id": [0, 1, 2], "prompt": ["a b", "c d", "e f"]})))
    assert exits == [1]  # the actor asked to exit, so Ray restarts it and retries the task
    pred.driver.shutdown()


def test_spark_task_fails_and_the_engine_cache_forgets_the_engine(
        model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[EngineDriver] = []

    def factory(spec: Any) -> EngineDriver:
        driver = build_driver(spec)
        built.append(driver)
        return break_after(driver, good_steps=1) if len(built) == 1 else driver

    cache = EngineCache(factory)
    monkeypatch.setattr(spark_engine_cache, "ENGINES", cache)
    monkeypatch.setattr(spark_task, "task_resources", lambda: ([], 1))
    settings = TaskSettings.create(model, {"max_tokens": 6, "ignore_eos": True}, "row", None,
                                   False, ENGINE, apply_chat_template=False)
    first = TaskSession(settings)
    futures = first.submit([{"prompt": "a b"}, {"prompt": "c d"}], ["k0", "k1"])
    with pytest.raises(EngineDeadError):  # not a row error: the task fails, Spark retries it
        first.output_rows(futures)
    assert built[0].dead is not None
    # the next task on this worker gets a new, working engine
    retry = TaskSession(settings)
    rows = retry.output_rows(retry.submit([{"prompt": "a b"}], ["k0"]))
    assert len(built) == 2 and rows[0]["error"] is None and rows[0]["num_generated_tokens"] == 6
    cache.clear()
