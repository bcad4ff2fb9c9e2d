"""`build_processor`: a drop-in for `ray.data.llm.build_processor` over `BatchGenPredictor`.

    config = BatchGenProcessorConfig(model_source=None, concurrency=2, batch_size=32,
                                     sampling_params={"max_tokens": 64})
    processor = build_processor(config, preprocess=lambda r: {"prompt": r["text"]},
                                postprocess=lambda r: {"id": r["id"],
                                                       "answer": r["generated_text"]})
    out = processor(ds)

As in Ray, the preprocess's output is merged into its row and the postprocess's output is the
row; the postprocess also sees the fields `ray.data.llm`'s vLLM stage gives
(`generated_tokens`, `num_input_tokens`, ...), so a postprocess written for Ray's processor
runs unchanged (`ray_llm_compat.py`). The config is `ray_processor_config.py`. Building a
processor imports Ray and installs the row-streaming rule (`ray_blocks`) in this driver
process, where Ray Data plans the job.
"""
from __future__ import annotations

import re
import uuid
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from batchgen_data.connectors.ray import blocks as ray_blocks
from batchgen_data.connectors.ray import grouping as ray_grouping
from batchgen_data.connectors.ray.llm_compat import (BUILDER_KWARGS, VLLM_FIELDS, MergedPreprocess,
                                                     VllmFieldsThen, with_vllm_fields)
from batchgen_data.connectors.ray.predictor import BatchGenPredictor
from batchgen_data.connectors.ray.processor_config import (
    MAX_WINDOW_BATCHES, POOLING_ROW_TOKENS, BatchGenProcessorConfig, window_batches)
from batchgen_data.connectors.resume import checkpoint_config

if TYPE_CHECKING:
    import ray.data

Row = dict[str, Any]


class Processor:
    """`processor(ds) -> ds`: optional preprocess, the predictor, optional postprocess."""

    def __init__(self, config: BatchGenProcessorConfig,
                 preprocess: Callable[[Row], Row] | None = None,
                 postprocess: Callable[[Row], Row] | None = None,
                 preprocess_map_kwargs: dict[str, Any] | None = None,
                 postprocess_map_kwargs: dict[str, Any] | None = None,
                 prefix_grouping: bool = False,
                 prefix_chars: int = ray_grouping.DEFAULT_PREFIX_CHARS) -> None:
        self.config = config
        # sort rows by a hash of their leading text before blocks are cut (ray/grouping.py)
        self.prefix_grouping = prefix_grouping
        self.prefix_chars = ray_grouping.check_prefix_chars(prefix_chars)
        self.preprocess = (None if preprocess is None else
                           MergedPreprocess(preprocess, detokenize=config.detokenize_on))
        self.postprocess = None if postprocess is None else VllmFieldsThen(postprocess)
        # light row functions: a quarter CPU each, so they run beside the engine actors
        self.preprocess_map_kwargs = {"num_cpus": 0.25, **(preprocess_map_kwargs or {})}
        self.postprocess_map_kwargs = {"num_cpus": 0.25, **(postprocess_map_kwargs or {})}
        # one migration coordinator per processor: its actors move work among themselves only
        self.job_id = uuid.uuid4().hex[:16]
        self.predictor: type[BatchGenPredictor] = BatchGenPredictor  # seam for benchmarks
        self.predictor_kwargs: dict[str, Any] = {}  # and the extra arguments a subclass takes
        ray_blocks.install()  # the rule must be in the driver before Ray Data plans the job

    def __call__(self, ds: "ray.data.Dataset") -> "ray.data.Dataset":
        if self.config.resume_from is not None:
            # the Dataset's own context (shared by the Datasets made from it), not the
            # driver's current one: other jobs in this process are not checkpointed
            ds.context.checkpoint_config = checkpoint_config(self.config.resume_from,
                                                             self.config.id_column)
        if self.preprocess is not None:
            ds = ds.map(self.preprocess, **self.preprocess_map_kwargs)
        if self.prefix_grouping:
            ds = ray_grouping.group_by_prefix(ds, self.prefix_chars, self.preprocess_map_kwargs)
        # One input batch per block: Ray hands a task's batches to the UDF one after another,
        # so rows of a big block would reach the engine one batch at a time. `strict`: Ray
        # 2.60's default (non-strict) repartition leaves one short block per input block
        # (200 blocks of 20 rows became 16 + 5), which the map's bundler (min rows = batch_size)
        # joins into 21-row tasks of two calls, the second waiting for the first's slowest row.
        ds = ds.repartition(target_num_rows_per_block=self.config.batch_size, strict=True)
        quiet_small_input_warning(self.predictor.__name__)
        kw = self.config.map_batches_kwargs(self.job_id)
        kw["fn_constructor_kwargs"].update(self.predictor_kwargs)
        ds = ds.map_batches(self.predictor, **kw)
        if self.postprocess is not None:
            ds = ds.map(self.postprocess, **self.postprocess_map_kwargs)
        return ds


def quiet_small_input_warning(predictor_name: str) -> None:
    """Silence Ray Data's "minimum number of concurrent actors" warning for our operator only.

    Ray Data warns when an actor pool of n receives fewer than n blocks, and suggests more
    blocks (`override_num_blocks`). Here a block is one input batch on purpose (see
    `Processor.__call__`), so a job smaller than n batches simply leaves an engine idle; the
    pool size is the user's choice for the data they expect, and the warning has no fix to offer.
    """
    op = re.escape(f"MapBatches({predictor_name})")
    warnings.filterwarnings("ignore", category=UserWarning,
                            message=f"The minimum number of concurrent actors for '{op}'")


def build_processor(config: BatchGenProcessorConfig,
                    preprocess: Callable[[Row], Row] | None = None,
                    postprocess: Callable[[Row], Row] | None = None,
                    preprocess_map_kwargs: dict[str, Any] | None = None,
                    postprocess_map_kwargs: dict[str, Any] | None = None,
                    builder_kwargs: dict[str, Any] | None = None,
                    prefix_grouping: bool = False,
                    prefix_chars: int = ray_grouping.DEFAULT_PREFIX_CHARS) -> Processor:
    """Same call shape as `ray.data.llm.build_processor`; `builder_kwargs` takes what Ray's
    vLLM builder takes (`chat_template_kwargs`, which then applies to every row).
    `prefix_grouping`: sort rows by a hash of their first `prefix_chars` characters before
    blocks are cut, so rows sharing a prefix share an input batch (docs/ray_data.md)."""
    if not isinstance(config, BatchGenProcessorConfig):
        raise TypeError(f"config must be BatchGenProcessorConfig, got {type(config).__name__}")
    if not isinstance(prefix_grouping, bool):
        raise TypeError(f"prefix_grouping must be a bool, got {type(prefix_grouping).__name__}")
    extra = dict(builder_kwargs or {})
    reserved = sorted({"preprocess", "postprocess", "preprocess_map_kwargs",
                       "postprocess_map_kwargs"} & set(extra))
    if reserved:
        raise ValueError(f"builder_kwargs cannot contain {reserved}: pass them to "
                         "build_processor directly")
    unknown = sorted(set(extra) - set(BUILDER_KWARGS))
    if unknown:
        raise ValueError(f"builder_kwargs {unknown}: not taken here; valid: {list(BUILDER_KWARGS)}")
    if "chat_template_kwargs" in extra:
        config = replace(config, chat_template_kwargs=extra["chat_template_kwargs"])
    return Processor(config, preprocess, postprocess, preprocess_map_kwargs,
                     postprocess_map_kwargs, prefix_grouping, prefix_chars)


__all__ = ["BatchGenProcessorConfig", "MAX_WINDOW_BATCHES", "POOLING_ROW_TOKENS", "Processor",
           "VLLM_FIELDS", "build_processor", "window_batches", "with_vllm_fields"]
