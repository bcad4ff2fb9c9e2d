"""The Ray Data connector's public names, in one place.

    ds.map_batches(BatchGenPredictor, ...)          # by hand (connectors/ray/predictor.py)
    build_processor(BatchGenProcessorConfig(...))   # ray.data.llm's shape (ray_processor.py)

Rows stream out of the predictor as they finish once Ray Data's optimizer has the row-streaming
rule (`ray_blocks`). Importing the predictor (this module imports it) adds the rule, so
`ds.map_batches(BatchGenPredictor, ...)` streams as written; the rule touches only operators
that run a streaming `BatchGenPredictor` (docs/ray_data.md, "How rows stream").
"""
from __future__ import annotations

from batchgen_data.connectors.ray.blocks import install as _install_rule
from batchgen_data.connectors.ray.predictor import BatchGenPredictor
from batchgen_data.connectors.ray.processor import (
    BatchGenProcessorConfig, Processor, build_processor, window_batches)


def enable_row_streaming() -> bool:
    """Kept for jobs written before the rule came with the import: True when the rule is in
    Ray Data's optimizer in this process (it adds it if not); False when this Ray version's
    internals differ (rows then come back per input batch)."""
    return _install_rule()


__all__ = ["BatchGenPredictor", "BatchGenProcessorConfig", "Processor", "build_processor",
           "enable_row_streaming", "window_batches"]
