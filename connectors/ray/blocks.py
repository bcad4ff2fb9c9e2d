"""Row streaming out of a Ray Data operator: a per-operator output block size.

Ray Data (2.60) puts what a `map_batches` generator yields into an output buffer that becomes a
block only when it holds more than `DataContext.target_max_block_size` bytes (128 MiB) or the
task ends. Finished rows of a 32-row input batch would therefore wait for its slowest row,
which is exactly what streaming is meant to avoid. Measured on a 2-CPU box:

- default target: 8 rows yielded 0.25 s apart reach `iter_batches` together at task end;
- a 1-byte target set on the whole plan (a copied `DataContext`): each yield arrives about
  0.4 s after it is made, but the read upstream also turns into 1-row blocks, which slows the
  whole job many times over;
- the 1-byte target on the predictor's operator only: one-row blocks are cheap on a threaded
  actor (`max_concurrency` > 1) and costly on a single-threaded one.

Ray offers no per-operator setting through `map_batches`, so this module adds a rule to Ray
Data's physical optimizer (a DeveloperAPI ruleset) that lowers the target on the last
transform of operators that run a streaming `BatchGenPredictor`, and nowhere else. Ray then
emits each yielded output as soon as it is yielded (split into one-row blocks). Without the rule
(another Ray version) results stay correct; rows only arrive when their task ends.

The rule is added when `connectors/ray/predictor.py` is imported, which a driver must do to
pass `BatchGenPredictor` to `map_batches`: the one line streams as written. It stays out of
other operators' way because it changes nothing but the last transform's output block target
of a physical operator one of whose logical operators is a map over a class with
`streams_rows = True` and a streaming `stream` (`is_streaming_udf`): every other operator's
plan, the read's block size, and the operator-level `target_max_block_size_override` that Ray
propagates upstream are left as they were (it runs after Ray's own rules, so nothing
propagates it). An operator fused into the predictor's (a `map` before it) keeps its own
transforms; only the fused operator's output is cut per row.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

STREAM_BLOCK_BYTES = 1  # any yield exceeds it, so each one is flushed at once
_installed = False


def is_streaming_udf(logical_op: Any) -> bool:
    """True for a map op over a callable class that declares `streams_rows` and streams."""
    fn = getattr(logical_op, "fn", None)
    if not isinstance(fn, type) or not getattr(fn, "streams_rows", False):
        return False
    kwargs = getattr(logical_op, "fn_constructor_kwargs", None) or {}
    return bool(kwargs.get("stream", getattr(fn, "default_stream", True)))


def _make_rule_class() -> type:
    from ray.data._internal.logical.interfaces import Rule

    class StreamRowsRule(Rule):
        """Set a tiny output block target on streaming-predictor operators only."""

        def apply(self, plan: Any) -> Any:
            for op in plan.dag.post_order_iter():
                logical = list(getattr(op, "_logical_operators", None) or [])
                if op in plan.op_map:
                    logical.append(plan.op_map[op])
                if not any(is_streaming_udf(lop) for lop in logical):
                    continue
                get_transformer = getattr(op, "get_map_transformer", None)
                if get_transformer is None:
                    continue
                last = get_transformer().get_transform_fns()[-1]
                if last.target_max_block_size != STREAM_BLOCK_BYTES:
                    last.override_target_max_block_size(STREAM_BLOCK_BYTES)
            return plan

    return StreamRowsRule


def install(quiet_without_ray: bool = False) -> bool:
    """Register the rule once in this (driver) process; False when Ray's internals differ
    (or, silently with `quiet_without_ray`, when Ray Data is not installed)."""
    global _installed
    if _installed:
        return True
    try:
        import ray.data  # noqa: F401
    except ImportError:
        if not quiet_without_ray:
            log.warning("batchgen: Ray Data is not installed; no row-streaming rule")
        return False
    try:
        from ray.data._internal.logical.optimizers import get_physical_ruleset

        get_physical_ruleset().add(_make_rule_class())
    except Exception as e:  # noqa: BLE001 - any mismatch only costs streaming, not results
        log.warning("batchgen_data: cannot install the row-streaming rule (%r); rows will "
                    "reach the consumer when each input batch's task ends", e)
        return False
    _installed = True
    return True
