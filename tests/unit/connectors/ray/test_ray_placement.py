"""The placement group of a tensor-parallel engine actor (`connectors/ray/placement.py`) and the
`distributed_executor_backend` setting, as pure functions (no Ray cluster is started)."""
from __future__ import annotations

import pytest

pytest.importorskip("ray")

from batchgen_data.config import make_engine_config  # noqa: E402
from batchgen_data.connectors.ray import placement as ray_placement  # noqa: E402
from batchgen_data.connectors.ray.processor import BatchGenProcessorConfig  # noqa: E402


def test_default_bundles_are_one_per_rank_of_the_actor_resources() -> None:
    bundles, strategy = ray_placement.rank_bundles(2, 0.5, 2.0, {"node_a": 1}, None)
    assert bundles == [{"CPU": 0.5, "GPU": 1.0, "node_a": 1}] * 2 and strategy == "PACK"
    assert ray_placement.actor_resources(bundles[0]) == {
        "num_cpus": 0.5, "num_gpus": 1.0, "resources": {"node_a": 1}}


def test_a_placement_group_config_in_ray_data_llm_shape() -> None:
    bundles, strategy = ray_placement.rank_bundles(
        3, 1, 0, None, {"bundle_per_worker": {"CPU": 2, "GPU": 1}, "strategy": "STRICT_PACK"})
    assert bundles == [{"CPU": 2.0, "GPU": 1.0}] * 3 and strategy == "STRICT_PACK"
    with pytest.raises(ValueError, match="tensor_parallel_size=2 non-empty bundles"):
        ray_placement.rank_bundles(2, 1, 0, None, {"bundles": [{"GPU": 1}]})
    with pytest.raises(ValueError, match="strategy='TIGHT'"):
        ray_placement.rank_bundles(1, 1, 0, None, {"bundles": [{"GPU": 1}], "strategy": "TIGHT"})
    with pytest.raises(ValueError, match="unknown key"):
        ray_placement.rank_bundles(1, 1, 0, None, {"bundles": [{"GPU": 1}], "name": "x"})


def test_a_tensor_parallel_processor_runs_its_actor_in_bundle_0_of_a_group() -> None:
    cfg = BatchGenProcessorConfig(num_cpus=0.5, num_gpus=2, resources={"node_a": 1},
                                  engine_kwargs={"tensor_parallel_size": 2})
    assert cfg.constructor_kwargs()["distributed_executor_backend"] == "ray"
    kw = cfg.map_batches_kwargs()
    assert kw["num_cpus"] == 0.5 and kw["num_gpus"] == 1.0 and kw["resources"] == {"node_a": 1}
    fn = kw["ray_remote_args_fn"]
    assert fn.args == ([{"CPU": 0.5, "GPU": 1.0, "node_a": 1}] * 2, "PACK")


def test_one_device_or_process_ranks_get_no_group() -> None:
    assert "ray_remote_args_fn" not in BatchGenProcessorConfig().map_batches_kwargs()
    mp = BatchGenProcessorConfig(num_gpus=2, engine_kwargs={
        "tensor_parallel_size": 2, "distributed_executor_backend": "mp"})
    kw = mp.map_batches_kwargs()
    assert "ray_remote_args_fn" not in kw and kw["num_gpus"] == 2  # the actor holds both
    with pytest.raises(ValueError, match="bundles"):
        BatchGenProcessorConfig(engine_kwargs={"tensor_parallel_size": 2},
                                placement_group_config={"bundles": [{"CPU": 1}]})


@pytest.mark.parametrize("backend, tp, ok", [
    (None, 2, True), ("mp", 2, True), ("ray", 2, True), ("uni", 1, True), ("uni", 2, False),
    ("external_launcher", 2, False)])
def test_distributed_executor_backend_values(backend: str | None, tp: int, ok: bool) -> None:
    if ok:
        make_engine_config(tensor_parallel_size=tp, distributed_executor_backend=backend)
    else:
        with pytest.raises(ValueError, match=f"distributed_executor_backend={backend!r}"):
            make_engine_config(tensor_parallel_size=tp, distributed_executor_backend=backend)


def test_ray_ranks_need_a_ray_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from batchgen_data.worker.tp.launch import launcher_for

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a process without Ray
    with pytest.raises(ValueError, match="not connected to a Ray cluster"):
        launcher_for("ray", 2)
