"""The deep window on real Ray Data jobs with a tiny Llama.

* `build_processor` with its defaults serves `window_batches(max_num_seqs, batch_size, 2)` input
  batches per actor, so one engine holds rows of several batches at once;
* exactly once with late binding on (and migration off) when an actor is SIGKILLed mid-job:
  rows leave in input order (`stream="ordered"`), a moved queued row still returns through the
  task that received it, and Ray's retry of the dead actor's tasks repeats and loses nothing.
"""
from __future__ import annotations

import os
import random
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import us

import pyarrow as pa  # noqa: E402

from batchgen_data import LLM, SamplingParams  # noqa: E402
from batchgen_data.connectors.ray_data import (  # noqa: E402
    BatchGenPredictor, BatchGenProcessorConfig, build_processor, enable_row_streaming,
    window_batches)

pytestmark = pytest.mark.timeout(420)
ENGINE = {"max_model_len": 96, "max_num_seqs": 4}
BATCH = 2


class PeakRows(BatchGenPredictor):
    """Adds `peak_rows`: the most rows (running + queued) its engine has held at once so far."""

    def start_driver(self, model: str | None, engine_kwargs: dict[str, Any]) -> Any:
        driver = super().start_driver(model, engine_kwargs)
        self.peak = 0

        def watch(engine: Any) -> None:
            load = engine.load()
            self.peak = max(self.peak, load.waiting + load.running + load.held)

        driver.step_hooks.append(watch)
        return driver

    def __call__(self, batch: Any) -> Iterator[pa.Table]:
        for table in super().__call__(batch):
            yield table.append_column("peak_rows", pa.array([self.peak] * table.num_rows))


class KillsOnce(BatchGenPredictor):
    """SIGKILLs its own actor once per job after `after` rows have left it (a flag file makes
    the restarted actor, and the other one, carry on)."""

    def __init__(self, flag: str, after: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.flag, self.after, self.sent = flag, after, 0

    def __call__(self, batch: Any) -> Iterator[Any]:
        for table in super().__call__(batch):
            if self.sent >= self.after:
                try:
                    os.close(os.open(self.flag, os.O_CREAT | os.O_EXCL))
                    os.kill(os.getpid(), signal.SIGKILL)
                except FileExistsError:
                    pass
            self.sent += table.num_rows
            yield table


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[..., Path]) -> str:
    return str(tiny_model_dir("llama"))


def sampled_rows(seed: int, n: int) -> list[dict[str, Any]]:
    """Prompts and output lengths that vary, so rows finish out of input order."""
    rng = random.Random(seed)
    return [{"id": i, "prompt": f"Row {i}: " + " ".join(
                rng.choice(["fox", "sea", "wind", "paris", "invoice"])
                for _ in range(rng.randint(2, 10))),
             "sampling_params": {"temperature": 0.8, "seed": 1000 * seed + i,
                                 "max_tokens": rng.randint(2, 24), "ignore_eos": True}}
            for i in range(n)]


def offline(model: str, rows: list[dict[str, Any]]) -> dict[int, list[int]]:
    llm = LLM(model, **ENGINE)
    outs = llm.chat([[{"role": "user", "content": r["prompt"]}] for r in rows],
                    [SamplingParams(**r["sampling_params"]) for r in rows], use_tqdm=False)
    return {r["id"]: o.outputs[0].token_ids for r, o in zip(rows, outs)}


def check_exactly_once(model: str, rows: list[dict[str, Any]], got: list[dict[str, Any]]) -> None:
    ids = sorted(r["id"] for r in got)
    assert ids == [r["id"] for r in rows], \
        f"lost {set(r['id'] for r in rows) - set(ids)}, twice {sorted(i for i in ids if ids.count(i) > 1)}"
    want = offline(model, rows)
    for r in got:
        assert r["error"] is None, r["error"]
        assert list(r["generated_token_ids"]) == want[r["id"]], r["id"]


def test_an_engine_holds_rows_of_several_input_batches(ray_local: None, model: str) -> None:
    rows = sampled_rows(5, 24)
    config = BatchGenProcessorConfig(model_source=model, batch_size=BATCH, concurrency=2,
                                     engine_kwargs=ENGINE, migration=False)
    processor = build_processor(config)
    processor.predictor = PeakRows
    got = processor(ray.data.from_items(rows)).take_all()
    check_exactly_once(model, rows, got)
    calls = window_batches(ENGINE["max_num_seqs"], BATCH)  # 2 x 4 seats / 2 rows = 4
    assert config.map_batches_kwargs()["compute"].max_concurrent_calls_per_actor == calls == 4
    # rows of at least two input batches fed one engine at once, never more than the window
    peak = max(r["peak_rows"] for r in got)
    assert 2 * BATCH <= peak <= calls * BATCH, peak


@pytest.mark.slow
def test_late_binding_keeps_exactly_once_when_an_actor_is_killed(
        ray_local: None, model: str, tmp_path: Path) -> None:
    rows = sampled_rows(6, 48)
    flag = tmp_path / "killed"
    calls = window_batches(ENGINE["max_num_seqs"], BATCH)
    enable_row_streaming()
    got = ray.data.from_items(rows).repartition(target_num_rows_per_block=BATCH).map_batches(
        KillsOnce, batch_size=BATCH, batch_format="pyarrow",
        fn_constructor_kwargs=dict(model=model, flag=str(flag), after=len(rows) // 8,
                                   late_binding=True, migration=False,
                                   migration_options={"interval_s": 0.1}, **ENGINE),
        compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=calls,
                                           max_tasks_in_flight_per_actor=calls),
        num_cpus=0.5).take_all()
    assert flag.exists()  # an actor did die
    check_exactly_once(model, rows, got)
