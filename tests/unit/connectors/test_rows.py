"""connectors/handler.py and rows.py: one row lifecycle and one row-vs-engine-failure rule,
checked through both connectors (Ray's `BatchGenPredictor`, Spark's `TaskSession`) over the same
fake engine.

The fake engine decides by prompt text: "boom" fails at submit with a non-ValueError, "lost"
fails its Future with one, "die" finds the engine dead at submit, "dies later" kills the engine
while generating, "quiet" finishes empty with finish_reason "stop"; anything else answers "ok".
"""
from __future__ import annotations

import gc
import logging
import weakref
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, Callable

import pyarrow as pa
import pytest

from batchgen_data.connectors import handler
from batchgen_data.connectors.common import RequestBuilder
from batchgen_data.connectors.handler import RowError
from batchgen_data.connectors.ray import predictor as ray_predictor
from batchgen_data.connectors.ray.predictor import BatchGenPredictor
from batchgen_data.connectors.rows import EmptyAnswerWatch, GenerationRows
from batchgen_data.connectors.spark import engine_cache as spark_engine_cache, task as spark_task
from batchgen_data.connectors.spark.engine_cache import EngineCache
from batchgen_data.connectors.spark.task import TaskSession, TaskSettings
from batchgen_data.engine.driver import EngineDeadError
from batchgen_data.outputs import CompletionOutput, RequestOutput
from batchgen_data.sampling_params import SamplingParams


class CharTokenizer:
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 97 for c in text]


class FakeDriver:
    def __init__(self, *_: Any) -> None:
        self.engine = self
        self.tokenizer = CharTokenizer()
        self.config = SimpleNamespace(seed=0)
        self.stats = SimpleNamespace(batch_seqs_hist={})
        self.dead: BaseException | None = None
        self.aborted: list[str] = []
        self.hold = False  # True: requests stay unfinished until the test ends them
        self.held: list[tuple[str, Future]] = []

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        if len(ids) > 30:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is 30")

    def lora_names(self) -> None:  # an engine without enable_lora
        return None

    def check_lora(self, lora: Any) -> None:
        pass

    def submit(self, ids: list[int], params: SamplingParams, request_id: str | None = None,
               prompt: str | None = None) -> Future:
        if prompt == "boom":
            raise RuntimeError("tokenizer exploded")
        if prompt == "die":
            self.dead = RuntimeError("CUDA error")
        if self.dead is not None:
            raise EngineDeadError("engine loop died: CUDA error")
        fut: Future = Future()
        if self.hold:
            self.held.append((request_id or "", fut))
        elif prompt == "lost":
            fut.set_exception(KeyError("request vanished"))
        elif prompt == "dies later":
            self.dead = RuntimeError("CUDA error")
            fut.set_exception(EngineDeadError("engine loop died: CUDA error"))
        else:
            text = "" if prompt == "quiet" else "ok"
            out = [CompletionOutput(0, text, [2] if text == "" else [7], "stop")]
            fut.set_result(RequestOutput(request_id or "r", prompt, ids, out))
        return fut

    def call(self, fn: Callable[[Any], Any]) -> None:
        fn(self)

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True

    def shutdown(self, timeout: float = 1.0) -> None:
        pass


class Connector:
    """Runs rows through one connector over a FakeDriver; `lost_engine` says what it did when
    the engine died (Ray: exit the actor; Spark: drop the cached engine)."""

    def __init__(self, kind: str, monkeypatch: pytest.MonkeyPatch, on_error: str = "row") -> None:
        self.kind, self.driver = kind, FakeDriver()
        self.exits: list[int] = []
        self.builds: list[Any] = []
        if kind == "ray":
            monkeypatch.setattr(ray_predictor.os, "_exit", self.exits.append)
            driver = self.driver

            class OnFake(BatchGenPredictor):
                def start_driver(self, model: Any, engine_kwargs: Any) -> FakeDriver:
                    return driver

            self.predictor = OnFake(sampling_params={"max_tokens": 4}, on_error=on_error,
                                    migration=False)
        else:
            monkeypatch.setattr(spark_engine_cache, "ENGINES", EngineCache(self._build))
            monkeypatch.setattr(spark_task, "task_resources", lambda: ([], 1))
            self.session = TaskSession(TaskSettings.create(None, {"max_tokens": 4}, on_error,
                                                           None, False, {}))

    def _build(self, spec: Any) -> FakeDriver:
        self.builds.append(spec)
        return self.driver

    def run(self, prompts: list[str]) -> list[dict[str, Any]]:
        if self.kind == "ray":
            table = pa.table({"prompt": prompts})
            out = [r for t in self.predictor(table) for r in t.to_pylist()]
            return sorted(out, key=lambda r: prompts.index(r["prompt"]))
        futures = self.session.submit([{"prompt": p} for p in prompts], prompts)
        return self.session.output_rows(futures)

    def lost_engine(self) -> bool:
        if self.kind == "ray":
            return self.exits == [1]
        spark_engine_cache.ENGINES.get(self.session.settings.spec.resolved("cpu", 1))
        return len(self.builds) == 2  # the dead engine was dropped, so it was built again


KINDS = ["ray", "spark"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_failure_of_one_row_is_that_rows_error(kind: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    c = Connector(kind, monkeypatch)
    out = c.run(["fine", "", "boom", "lost", "x" * 40])
    assert [r["error"] is None for r in out] == [True, False, False, False, False]
    assert out[0]["generated_text"] == "ok"
    assert out[1]["error"] == "prompt is empty: The decoder prompt cannot be empty"
    assert out[2]["error"] == "RuntimeError: tokenizer exploded"
    assert out[3]["error"] == "KeyError: 'request vanished'"
    assert "max_model_len" in out[4]["error"]
    assert all(r["generated_text"] == "" and r["finish_reason"] is None for r in out[1:])
    assert not c.lost_engine()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prompt", ["die", "dies later"])
def test_a_dead_engine_fails_the_task_and_drops_the_engine(
        kind: str, prompt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    c = Connector(kind, monkeypatch)
    with pytest.raises(EngineDeadError):
        c.run(["fine", prompt])
    assert c.lost_engine()


@pytest.mark.parametrize("kind", KINDS)
def test_on_error_raise_fails_on_the_first_row_error(kind: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    c = Connector(kind, monkeypatch, on_error="raise")
    with pytest.raises(RowError, match="RuntimeError: tokenizer exploded"):
        c.run(["fine", "boom"])
    c = Connector(kind, monkeypatch, on_error="raise")
    with pytest.raises(RowError, match="KeyError"):
        c.run(["lost"])
    assert not c.lost_engine()


def lifecycle(driver: FakeDriver, on_error: str = "row") -> GenerationRows:
    builder = RequestBuilder(driver.tokenizer, {"max_tokens": 4}, driver.check_request)
    return GenerationRows(driver, builder, base_seed=0, on_error=on_error, request_prefix="t")


def test_abandon_aborts_only_rows_still_in_flight() -> None:
    driver = FakeDriver()
    life = lifecycle(driver)
    done = life.submit({"prompt": "a"})
    driver.hold = True
    held = [life.submit({"prompt": p}) for p in ("b", "c")]
    life.outcome(done)
    life.abandon([done, *held])
    assert driver.aborted == [rid for rid, _ in driver.held]
    life.abandon(held)  # twice is harmless
    assert len(driver.aborted) == 2


def test_on_error_is_checked() -> None:
    with pytest.raises(ValueError, match="on_error='skip'"):
        lifecycle(FakeDriver(), on_error="skip")
    assert handler.ON_ERROR == ("row", "raise")
    assert not hasattr(spark_task, "ON_ERROR") and not hasattr(ray_predictor, "ON_ERROR")


def test_empty_answers_warn_once_per_engine(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="batchgen_data.connectors.rows")
    driver = FakeDriver()
    first, second = lifecycle(driver), lifecycle(driver)  # two tasks, one engine
    for i in range(60):
        life = first if i % 2 else second
        life.outcome(life.submit({"prompt": "quiet" if i % 4 == 0 else f"q{i}"}))
    warnings = [r for r in caplog.records if "empty generated_text" in r.getMessage()]
    assert len(warnings) == 1
    assert "5 of the first 20" in warnings[0].getMessage()
    assert "apply_chat_template=True" in warnings[0].getMessage()


def test_no_warning_when_few_rows_are_empty(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="batchgen_data.connectors.rows")
    life = lifecycle(FakeDriver())
    for i in range(100):
        life.outcome(life.submit({"prompt": "quiet" if i % 10 == 0 else f"q{i}"}))
    assert not [r for r in caplog.records if "empty generated_text" in r.getMessage()]


def test_watch_is_per_engine_and_dies_with_it() -> None:
    a, b = FakeDriver(), FakeDriver()
    assert EmptyAnswerWatch.of(a) is EmptyAnswerWatch.of(a)
    assert EmptyAnswerWatch.of(a) is not EmptyAnswerWatch.of(b)
    ref = weakref.ref(a)
    del a
    gc.collect()  # the fake driver is its own engine: a cycle
    assert ref() is None
