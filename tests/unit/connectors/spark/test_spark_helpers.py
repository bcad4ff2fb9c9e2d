"""Executor-side pieces of the Spark connector that need no JVM: device choice, per-row seeds,
settings validation, the engine cache, and a task session over a fake engine."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

import pytest

from batchgen_data.connectors.spark import engine_cache as spark_engine_cache, task as spark_task
from batchgen_data.connectors.common import derive_seed, seeded
from batchgen_data.connectors.spark.engine_cache import EngineCache, EngineSpec
from batchgen_data.connectors.row_kinds import value_row
from batchgen_data.connectors.spark.task import TaskSession, TaskSettings
from batchgen_data.worker.devices import pick_device
from batchgen_data.outputs import CompletionOutput, RequestOutput
from batchgen_data.sampling_params import SamplingParams


@pytest.mark.parametrize("gpus, visible, cuda, expected", [
    (["1"], None, True, "cuda:1"),          # Spark's address, nothing masked
    (["3"], "2,3", True, "cuda:1"),         # address re-numbered inside CUDA_VISIBLE_DEVICES
    ([], "5", True, "cuda:0"),              # no Spark GPU resource, but a visible device
    (["0"], None, False, "cpu"),            # torch without CUDA
    ([], "-1", True, "cpu"),
    ([], None, True, "cpu"),                # GPUs exist but this task was given none
])
def test_pick_device(gpus: list[str], visible: str | None, cuda: bool, expected: str) -> None:
    assert pick_device("auto", gpus, visible, cuda) == expected


def test_derived_seed_is_stable_and_row_specific() -> None:
    assert derive_seed(0, "a") == derive_seed(0, "a")
    assert len({derive_seed(0, "a"), derive_seed(0, "b"), derive_seed(1, "a")}) == 3
    assert 0 <= derive_seed(7, "x" * 1000) < 2**31
    user = SamplingParams(seed=5)
    assert seeded(user, 0, "k") is user
    assert seeded(SamplingParams(), 0, 12).seed == derive_seed(0, "12")


def test_value_row_detects_input_kind() -> None:
    assert value_row("hi") == {"prompt": "hi"}
    assert value_row(None) == {"prompt": None}
    assert value_row([1, 2]) == {"prompt_token_ids": [1, 2]}
    assert value_row([{"role": "user", "content": "x"}]) == {
        "messages": [{"role": "user", "content": "x"}]}


def test_settings_validate_on_the_driver() -> None:
    with pytest.raises(TypeError, match="max_num_seq"):
        TaskSettings.create(None, None, "row", None, False, {"max_num_seq": 4})
    with pytest.raises(ValueError, match="on_error"):
        TaskSettings.create(None, None, "skip", None, False, {})
    with pytest.raises(ValueError, match="max_in_flight"):
        TaskSettings.create(None, None, "row", 0, False, {})
    with pytest.raises(TypeError, match="temprature"):
        TaskSettings.create(None, {"temprature": 0}, "row", None, False, {})
    s = TaskSettings.create("m", {"max_tokens": 3}, "row", None, False, {"max_num_seqs": 8})
    assert s.max_in_flight == 16 and s.rows.sampling_params["max_tokens"] == 3


def test_spec_resolution_keeps_user_choices() -> None:
    spec = EngineSpec.create(None, {"max_num_seqs": 4})
    assert spec.resolved("cuda:1", 4).kwargs == {"max_num_seqs": 4, "device": "cuda:1"}
    assert spec.resolved("cpu", 2).kwargs["num_threads"] == 2
    mine = EngineSpec.create(None, {"device": "cpu", "num_threads": 8})
    assert mine.resolved("cuda:0", 2).kwargs == {"device": "cpu", "num_threads": 8}


class FakeDriver:
    def __init__(self, spec: EngineSpec) -> None:
        self.spec, self.down, self.submitted, self.aborted = spec, False, [], []
        self.pending = False  # True: submitted requests stay unfinished
        self.engine = self

    tokenizer = None
    dead = None
    stats = type("Stats", (), {"batch_seqs_hist": {}})()

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        if len(ids) > 4:
            raise ValueError("prompt has too many tokens; max_model_len is 5")

    def lora_names(self) -> None:  # an engine without enable_lora
        return None

    def check_lora(self, lora: Any) -> None:
        pass

    def submit(self, ids: list[int], params: SamplingParams, request_id: str | None = None,
               prompt: str | None = None) -> Future:
        self.check_request(ids, params)
        self.submitted.append(params.seed)
        fut: Future = Future()
        if not self.pending:
            out = [CompletionOutput(0, "ok", [7], "length")]
            fut.set_result(RequestOutput(request_id or "r", prompt, ids, out))
        return fut

    def call(self, fn: Callable[[Any], Any]) -> None:
        fn(self)

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True

    def shutdown(self) -> None:
        self.down = True


def test_engine_cache_builds_once_and_replaces_on_new_config() -> None:
    cache = EngineCache(FakeDriver)
    a = EngineSpec.create(None, {"max_num_seqs": 4})
    first = cache.get(a)
    assert cache.get(EngineSpec.create(None, {"max_num_seqs": 4})) is first
    second = cache.get(EngineSpec.create(None, {"max_num_seqs": 8}))
    assert second is not first and first.down
    cache.discard(first)  # not the cached one: no effect
    assert cache.get(EngineSpec.create(None, {"max_num_seqs": 8})) is second
    cache.discard(second)
    assert cache.get(EngineSpec.create(None, {"max_num_seqs": 8})) is not second


def test_task_session_rows_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spark_engine_cache, "ENGINES", EngineCache(FakeDriver))
    monkeypatch.setattr(spark_task, "task_resources", lambda: ([], 1))
    settings = TaskSettings.create(None, {"temperature": 1.0}, "row", None, True, {})
    session = TaskSession(settings)
    rows = [{"prompt_token_ids": [1, 2]}, {"prompt": None}, {"prompt_token_ids": [1] * 9}]
    futures = session.submit(rows, ["a", "b", "c"])
    out = session.output_rows(futures)
    assert [r["error"] is None for r in out] == [True, False, False]
    assert out[0]["generated_text"] == "ok" and "null" in out[1]["error"]
    assert "max_model_len" in out[2]["error"]
    assert all(spark_task.DEBUG_FIELD in r for r in out)
    driver = spark_engine_cache.ENGINES.get(settings.spec.resolved("cpu", 1))
    assert driver.submitted == [derive_seed(0, "a")]

    strict = TaskSession(TaskSettings.create(None, None, "raise", None, False, {}))
    with pytest.raises(ValueError, match="null"):
        strict.submit([{"prompt": None}], ["k"])


def test_task_session_aborts_abandoned_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spark_engine_cache, "ENGINES", EngineCache(FakeDriver))
    monkeypatch.setattr(spark_task, "task_resources", lambda: ([], 1))
    session = TaskSession(TaskSettings.create(None, None, "row", None, False, {}))
    session.submit([{"prompt_token_ids": [1]}], ["a"])  # finishes at once
    driver = spark_engine_cache.ENGINES.get(session.settings.spec.resolved("cpu", 1))
    driver.pending = True
    futures = session.submit([{"prompt_token_ids": [2]}, {"prompt_token_ids": [3]}], ["b", "c"])
    session.abandon(futures)
    assert len(driver.aborted) == 2 and len(set(driver.aborted)) == 2
    assert all(r.startswith("spark-") for r in driver.aborted)


class SpecRecorder:
    """Stands for `spark_engine_cache.ENGINES`: keeps the spec a task resolved."""

    def __init__(self) -> None:
        self.specs: list[EngineSpec] = []

    def get(self, spec: EngineSpec) -> object:
        self.specs.append(spec)
        return object()


@pytest.mark.parametrize("visible,want_device,want_ranks", [
    (None, "cuda:3", (3, 5)),  # no CUDA_VISIBLE_DEVICES: the addresses are the indices
    ("2,3,4,5", "cuda:1", (1, 3)),  # limited: each address's place in the visible list
])
def test_a_tensor_parallel_task_puts_its_ranks_on_the_gpus_it_holds(
        monkeypatch: pytest.MonkeyPatch, visible: str | None, want_device: str,
        want_ranks: tuple[int, ...]) -> None:
    """A task holding GPUs 3 and 5 (spark.task.resource.gpu.amount=2) runs its TP=2 engine's
    rank 0 on GPU 3 and rank 1 on GPU 5, not on cuda:0 and cuda:1 (another task's)."""
    rec = SpecRecorder()
    monkeypatch.setattr(spark_engine_cache, "ENGINES", rec)
    monkeypatch.setattr(spark_task, "cuda_is_available", lambda: True)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(spark_task, "task_resources", lambda: (["3", "5"], 4))
    settings = TaskSettings.create(None, None, "row", None, False, {"tensor_parallel_size": 2})
    spark_task.task_driver(settings)
    kw = rec.specs[-1].kwargs
    assert kw["device"] == want_device and kw["rank_devices"] == want_ranks
    # one rank, or a device the user named: nothing listed
    spark_task.task_driver(TaskSettings.create(None, None, "row", None, False, {}))
    assert "rank_devices" not in rec.specs[-1].kwargs
    spark_task.task_driver(TaskSettings.create(None, None, "row", None, False, {
        "tensor_parallel_size": 2, "device": "cuda:0"}))
    assert "rank_devices" not in rec.specs[-1].kwargs
    # fewer GPUs than ranks: refused by name, nothing loads
    monkeypatch.setattr(spark_task, "task_resources", lambda: (["3"], 4))
    with pytest.raises(ValueError, match=r"spark.task.resource.gpu.amount=2"):
        spark_task.task_driver(settings)
