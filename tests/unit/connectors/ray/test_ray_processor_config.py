"""`BatchGenProcessorConfig`'s mapping onto the predictor's constructor kwargs and
`map_batches` kwargs, as pure functions (no Ray cluster is started)."""
from __future__ import annotations

import pytest

pytest.importorskip("ray")

from batchgen_data import SamplingParams  # noqa: E402
from batchgen_data.connectors.ray.processor import BatchGenProcessorConfig  # noqa: E402


@pytest.mark.parametrize("concurrency, migration, want", [
    (1, None, False), (2, None, True), ((1, 3), None, True), ((2, 2), None, True),
    ((1, 1), None, False), (3, False, False), (1, True, True)])
def test_migration_is_on_when_the_pool_can_hold_more_than_one_actor(
        concurrency: int | tuple[int, int], migration: bool | None, want: bool) -> None:
    cfg = BatchGenProcessorConfig(concurrency=concurrency, migration=migration)
    assert cfg.migration_on is want
    assert cfg.constructor_kwargs()["migration"] is want


def test_error_policy_sampling_params_and_engine_kwargs_reach_the_predictor() -> None:
    sp = {"max_tokens": 7, "temperature": 0}
    cfg = BatchGenProcessorConfig(model_source="/m", should_continue_on_error=False,
                                  sampling_params=sp, stream=False, apply_chat_template=False,
                                  engine_kwargs={"max_num_seqs": 5, "block_size": 8},
                                  migration_options={"interval_s": 0.5})
    kw = cfg.constructor_kwargs(job_id="j1")
    assert kw["on_error"] == "raise" and kw["model"] == "/m"
    assert kw["sampling_params"] == sp and kw["stream"] is False
    assert kw["apply_chat_template"] is False
    assert kw["max_num_seqs"] == 5 and kw["block_size"] == 8
    assert kw["migration_options"] == {"job_id": "j1", "interval_s": 0.5}
    assert BatchGenProcessorConfig().constructor_kwargs()["on_error"] == "row"
    obj = SamplingParams(max_tokens=3)
    assert BatchGenProcessorConfig(sampling_params=obj).constructor_kwargs()["sampling_params"] is obj


def test_fixed_and_autoscaling_pools() -> None:
    fixed = BatchGenProcessorConfig(concurrency=3, batch_size=16, max_concurrent_batches=2)
    kw = fixed.map_batches_kwargs("j")
    pool = kw["compute"]
    assert (pool.min_size, pool.max_size) == (3, 3)
    # migration on: late binding, no batch queued at an actor beyond those it serves
    assert pool.max_tasks_in_flight_per_actor == 2 and pool.max_concurrent_calls_per_actor == 2
    assert kw["batch_size"] == 16 and kw["batch_format"] == "pyarrow"
    assert kw["fn_constructor_kwargs"]["migration_options"]["job_id"] == "j"
    assert "num_gpus" not in kw and "accelerator_type" not in kw and "resources" not in kw
    scaling = BatchGenProcessorConfig(concurrency=(1, 4), num_gpus=1, accelerator_type="H100",
                                      runtime_env={"env_vars": {"A": "1"}},
                                      resources={"engine": 1}).map_batches_kwargs()
    pool = scaling["compute"]
    assert (pool.min_size, pool.max_size) == (1, 4)
    assert scaling["num_gpus"] == 1 and scaling["accelerator_type"] == "H100"
    assert scaling["runtime_env"] == {"env_vars": {"A": "1"}}
    assert scaling["resources"] == {"engine": 1}  # one engine per node (docs/cluster-ray.md)
    # one actor, no migration: Ray's own default queueing is left alone
    single = BatchGenProcessorConfig(concurrency=1).map_batches_kwargs()["compute"]
    assert single.max_tasks_in_flight_per_actor is None
    explicit = BatchGenProcessorConfig(concurrency=2, max_tasks_in_flight_per_actor=6)
    assert explicit.map_batches_kwargs()["compute"].max_tasks_in_flight_per_actor == 6


@pytest.mark.parametrize("bad", [dict(concurrency=0), dict(concurrency=(3, 2)),
                                 dict(concurrency=(1, 2, 3)), dict(batch_size=0),
                                 dict(max_concurrent_batches=0), dict(num_gpus=-1),
                                 dict(resources={"engine": -1}),
                                 dict(resources={"engine": "one"})])
def test_bad_values_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        BatchGenProcessorConfig(**bad)


def test_typos_in_engine_kwargs_and_options_are_refused() -> None:
    with pytest.raises(TypeError):
        BatchGenProcessorConfig(engine_kwargs={"max_num_seq": 4})
    with pytest.raises(TypeError):
        BatchGenProcessorConfig(migration_options={"no_such_option": 1})
