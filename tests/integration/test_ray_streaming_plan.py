"""Row streaming is a rule in Ray Data's physical optimizer (`connectors/ray/blocks.py`): check
that it is installed and what it does to the physical plan, rather than timing rows.

The plan is built with Ray Data's own planner, without running the job: only the operator of
a streaming `BatchGenPredictor` gets the one-byte output block target.
"""
from __future__ import annotations

from typing import Any

import pytest

ray = pytest.importorskip("ray")

from batchgen_data.connectors.ray import blocks as ray_blocks  # noqa: E402
from batchgen_data.connectors.ray_data import BatchGenPredictor  # noqa: E402


def last_block_targets(ds: Any) -> dict[str, int | None]:
    """Operator name -> the output block target of its last transform (map operators only)."""
    from ray.data._internal.logical.optimizers import get_execution_plan

    plan = get_execution_plan(ds._logical_plan)
    plan = plan[0] if isinstance(plan, tuple) else plan  # Ray 2.5x returns (plan, extras)
    out = {}
    for op in plan.dag.post_order_iter():
        get = getattr(op, "get_map_transformer", None)
        if get is not None:
            out[op.name] = get().get_transform_fns()[-1].target_max_block_size
    return out


def test_the_rule_is_installed_and_marks_only_streaming_predictors(ray_local: None) -> None:
    from ray.data._internal.logical.optimizers import get_physical_ruleset

    # importing the predictor (above) installed it: no call needed
    assert "StreamRowsRule" in [r.__name__ for r in get_physical_ruleset()]
    assert ray_blocks.install() is True  # and a second install is a no-op
    assert [r.__name__ for r in get_physical_ruleset()].count("StreamRowsRule") == 1
    pool = ray.data.ActorPoolStrategy(size=1)
    base = ray.data.range(8)
    for kwargs in ({}, {"stream": True}, {"stream": "ordered"}):  # {}: the default streams
        streaming = last_block_targets(base.map_batches(BatchGenPredictor, compute=pool,
                                                        fn_constructor_kwargs=kwargs))
        assert list(streaming.values()) == [ray_blocks.STREAM_BLOCK_BYTES], kwargs
    # a map before the predictor is fused into its operator; the read stays as it was
    fused = last_block_targets(base.map(lambda r: r).map_batches(
        BatchGenPredictor, compute=pool, num_cpus=0.5))
    assert ray_blocks.STREAM_BLOCK_BYTES in fused.values()
    assert all(v != ray_blocks.STREAM_BLOCK_BYTES for k, v in fused.items()
               if "BatchGenPredictor" not in k), fused
    whole = last_block_targets(base.map_batches(BatchGenPredictor, compute=pool,
                                                fn_constructor_kwargs={"stream": False}))
    assert list(whole.values()) != [ray_blocks.STREAM_BLOCK_BYTES]

    class Other:
        def __call__(self, batch: Any) -> Any:
            return batch

    other = last_block_targets(base.map_batches(Other, compute=pool))
    assert ray_blocks.STREAM_BLOCK_BYTES not in other.values()
    plain = last_block_targets(base.map_batches(lambda b: b))
    assert ray_blocks.STREAM_BLOCK_BYTES not in plain.values()
