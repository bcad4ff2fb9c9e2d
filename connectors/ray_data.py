"""The Ray Data connector's public names, in one place.

    ds.map_batches(BatchGenPredictor, ...)          # by hand (connectors/ray_predictor.py)
    build_processor(BatchGenProcessorConfig(...))   # ray.data.llm's shape (ray_processor.py)

Importing this module changes nothing in Ray. Rows stream out of the predictor as they finish
only once Ray Data's optimizer has the row-streaming rule (`ray_blocks`): `build_processor`
installs it; a job that calls `map_batches` by hand calls `enable_row_streaming()` first, in the
driver. Without it results are the same, but each input batch's rows arrive together.
"""
from __future__ import annotations

from batchgen_data.connectors.ray_blocks import install as _install_rule
from batchgen_data.connectors.ray_predictor import BatchGenPredictor
from batchgen_data.connectors.ray_processor import (
    BatchGenProcessorConfig, Processor, build_processor, window_batches)


def enable_row_streaming() -> bool:
    """Let a hand-written `map_batches(BatchGenPredictor, ...)` job stream rows as they finish.

    Adds the rule to Ray Data's optimizer in this (driver) process, once; False when this Ray
    version's internals differ (rows then come back per input batch).
    """
    return _install_rule()


__all__ = ["BatchGenPredictor", "BatchGenProcessorConfig", "Processor", "build_processor",
           "enable_row_streaming", "window_batches"]
