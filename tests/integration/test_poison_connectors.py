"""A poisoned row among good ones through every connector front door (issue 57): the row
lifecycle, a Spark task's session, Ray Data's BatchGenPredictor on local Ray, Spark's
generate_df and batchgen_udf in local mode. Each good row comes out once with the tokens of an
unpoisoned engine, the poisoned one with a named error, and the job finishes:

* a step fault the engine can pin on the row (poison_engine.PoisonRunner): a row error, no
  engine death;
* a fault that takes the device with it (`kills_device`): the engine dies naming the step's
  rows as suspects; the retry (Ray: a restarted actor, through the poison-row record; Spark:
  the task, on a rebuilt engine) runs the suspects alone, the row kills the engine alone, and
  the next retry does not run it again ("poison row").
The fakes are parts given to the engine at seams (Ray's `start_driver`, the Spark engine
cache's factory, the Spark entry points' `engine_factory` where executors build the engine),
never an option made for them."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest

import poison_engine
from batchgen_data import LLM, SamplingParams
from batchgen_data.connectors.spark import engine_cache as spark_engine_cache, task as spark_task
from batchgen_data.connectors.common import RequestBuilder
from batchgen_data.connectors.handler import RowError
from batchgen_data.connectors.rows import GenerationRows
from batchgen_data.connectors.spark.engine_cache import EngineCache
from batchgen_data.connectors.spark.task import TaskSession, TaskSettings
from batchgen_data.engine.driver import EngineDriver
from poison_engine import POISON, poisoned_engine

pytestmark = pytest.mark.timeout(600)

ENGINE = {"max_model_len": 64, "max_num_seqs": 13, "block_size": 4}
PARAMS = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
IDS = [[5, 17, 42, 9], [100, 3, 77], [20, 21, POISON, 23], [40, 41, 43], [50, 51, 52, 53],
       [60, 61], [70, 71, 72]]
BAD = 2


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[[str], Path]) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def want(model: str) -> list[list[int]]:
    llm = LLM(model, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in IDS], SamplingParams(**PARAMS),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def check(rows: list[dict[str, Any]], want: list[list[int]], error: str) -> None:
    """`rows` in IDS order: the poisoned one errs with `error`, the others have `want`."""
    for i, (row, tokens) in enumerate(zip(rows, want)):
        if i == BAD:
            assert error in (row["error"] or ""), row["error"]
            assert list(row["generated_token_ids"] or []) == []
        else:
            assert row["error"] is None, (i, row["error"])
            assert list(row["generated_token_ids"]) == tokens, i


@pytest.mark.parametrize("on_error", ["row", "raise"])
def test_row_lifecycle(model: str, want: list[list[int]], on_error: str) -> None:
    driver = EngineDriver(poisoned_engine(model, device="cpu", **ENGINE))
    try:
        rows = GenerationRows(driver, RequestBuilder.from_engine(driver.engine, PARAMS), 0,
                            on_error)
        futures = [rows.submit({"prompt_token_ids": p}) for p in IDS]
        if on_error == "raise":
            with pytest.raises(RowError, match="RequestFailedError: the engine step failed"):
                rows.outcome(futures[BAD])
            return
        check([rows.outcome(f) for f in futures], want, "RequestFailedError: the engine step "
              "failed for this request alone (RuntimeError: a poisoned row is in this step)")
        assert driver.dead is None
    finally:
        driver.shutdown()


class PoisonFactory:
    """The Spark engine cache's factory, building poisoned engines; counts them."""

    def __init__(self, kills_device: bool) -> None:
        self.kills_device, self.built = kills_device, 0

    def __call__(self, spec: Any) -> Any:
        self.built += 1
        return EngineDriver(poisoned_engine(spec.model, kills_device=self.kills_device,
                                            **spec.kwargs))


@pytest.mark.parametrize("kills_device", [False, True])
def test_spark_task_session(model: str, want: list[list[int]], kills_device: bool,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    factory = PoisonFactory(kills_device)
    cache = EngineCache(factory)
    monkeypatch.setattr(spark_engine_cache, "ENGINES", cache)
    monkeypatch.setattr(spark_task, "task_resources", lambda: ([], 1))
    settings = TaskSettings.create(model, PARAMS, "row", None, False,
                                   {**ENGINE, "device": "cpu"}, apply_chat_template=False)
    session = TaskSession(settings)
    futures = session.submit([{"prompt_token_ids": p} for p in IDS], [str(p) for p in IDS])
    check(session.output_rows(futures), want, "poison row" if kills_device else
          "RequestFailedError")
    # two deaths (the crowded step, then the row alone), the third engine finished the task
    assert factory.built == (3 if kills_device else 1)
    cache.clear()


def predictor_class() -> type:
    from batchgen_data.connectors.ray_data import BatchGenPredictor

    class PoisonPredictor(BatchGenPredictor):
        """BatchGenPredictor whose engine is a poisoned one (the `start_driver` seam)."""

        def __init__(self, kills_device: bool = False, **kw: Any) -> None:
            self.kills_device = kills_device
            super().__init__(**kw)

        def start_driver(self, model: str | None, engine_kwargs: dict[str, Any]) -> Any:
            from batchgen_data.connectors.ray.predictor import default_device_kwargs
            return EngineDriver(poisoned_engine(model, kills_device=self.kills_device,
                                                **default_device_kwargs(engine_kwargs)))

    return PoisonPredictor


@pytest.mark.parametrize("kills_device,stream", [(False, True), (True, True),
                                                 (True, "ordered")])
def test_ray_data(ray_local: None, model: str, want: list[list[int]], kills_device: bool,
                  stream: Any) -> None:
    ray = pytest.importorskip("ray")
    ray.cloudpickle.register_pickle_by_value(poison_engine)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    items = [{"id": i, "prompt_token_ids": p} for i, p in enumerate(IDS)]
    got = ray.data.from_items(items).map_batches(
        predictor_class(), batch_size=len(IDS), batch_format="pyarrow",
        fn_constructor_kwargs=dict(model=model, kills_device=kills_device, stream=stream,
                                   sampling_params=PARAMS, migration=False, **ENGINE),
        compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.5).take_all()
    ids = sorted(r["id"] for r in got)
    assert ids == list(range(len(IDS))), ids  # every row once: none lost, none repeated
    check(sorted(got, key=lambda r: r["id"]), want,
          "poison row" if kills_device else "RequestFailedError")


@pytest.mark.parametrize("kills_device", [False, True])
def test_spark_generate_df_and_udf(spark: Any, model: str, want: list[list[int]],
                                   kills_device: bool) -> None:
    from batchgen_data.connectors.spark import batchgen_udf, generate_df

    # executors build their engine: the poisoned one comes from this module, shipped to them
    spark.sparkContext.addPyFile(poison_engine.__file__)
    factory = poison_engine.device_killing_engine if kills_device \
        else poison_engine.poisoned_run_engine
    kw = dict(model=model, sampling_params=PARAMS, apply_chat_template=False,
              engine_factory=factory, **ENGINE)
    df = spark.createDataFrame([(i, p) for i, p in enumerate(IDS)],
                               "id long, prompt_token_ids array<int>").coalesce(1)
    error = "poison row" if kills_device else "RequestFailedError"
    out = generate_df(df, prompt_col="prompt_token_ids", id_col="id", **kw)
    got = {r["id"]: r.asDict() for r in out.collect()}
    check([got[i] for i in range(len(IDS))], want, error)
    udf = batchgen_udf(**kw)
    rows = df.select("id", udf("prompt_token_ids").alias("r")).collect()
    check([r["r"].asDict() for r in sorted(rows, key=lambda r: r["id"])], want, error)
