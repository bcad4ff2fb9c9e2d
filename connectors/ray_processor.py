"""`build_processor`: a drop-in for `ray.data.llm.build_processor` over `BatchGenPredictor`.

    config = BatchGenProcessorConfig(model_source=None, concurrency=2, batch_size=32,
                                     sampling_params={"max_tokens": 64})
    processor = build_processor(config, preprocess=lambda r: {"prompt": r["text"], **r},
                                postprocess=lambda r: {"answer": r["generated_text"], **r})
    out = processor(ds)

Field names follow `ray.data.llm.vLLMEngineProcessorConfig` where the idea carries over; the
differences are listed in docs/ray_data.md. The postprocess function sees the output fields
`ray.data.llm`'s vLLM stage gives (`generated_tokens`, `num_input_tokens`, ...) besides this
project's own, so a postprocess written for Ray's processor runs unchanged (`with_vllm_fields`). Building a processor imports Ray and installs the
row-streaming rule (`ray_blocks`) in this driver process, where Ray Data plans the job.
"""
from __future__ import annotations

import math
import re
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchgen_data.chat import check_template_kwargs
from batchgen_data.config import make_engine_config
from batchgen_data.connectors import ray_blocks, ray_placement, row_extras
from batchgen_data.connectors.migration_options import MigrationOptions
from batchgen_data.connectors.ray_predictor import BatchGenPredictor
from batchgen_data.connectors.resume import checkpoint_config
from batchgen_data.sampling_params import SamplingParams

if TYPE_CHECKING:
    import ray.data

Row = dict[str, Any]


@dataclass(frozen=True)
class BatchGenProcessorConfig:
    """How to run `BatchGenPredictor` over a Dataset (vLLMEngineProcessorConfig's names)."""

    model_source: str | None = None  # None: the embedded default model
    batch_size: int = 32
    concurrency: int | tuple[int, int] = 1  # int n: n actors from the start; (m, n): autoscaling
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # `messages` through the chat template, and a plain `prompt` as one user turn
    apply_chat_template: bool = True
    chat_template: str | None = None  # a Jinja template instead of the tokenizer's
    chat_template_kwargs: Mapping[str, Any] | None = None  # e.g. {"enable_thinking": False}
    # input batches served at once by one actor (its max_concurrency); None: `window_batches`,
    # enough for `window_depth` x max_num_seqs rows in its engine
    max_concurrent_batches: int | None = None
    window_depth: float = 2.0  # rows in an engine's window per seat: the seats plus a queue
    max_tasks_in_flight_per_actor: int | None = None
    should_continue_on_error: bool = True  # False: the first bad row fails the job
    accelerator_type: str | None = None
    runtime_env: dict[str, Any] | None = None
    # this project's own
    sampling_params: SamplingParams | Mapping[str, Any] | None = None  # defaults for every row
    num_cpus: float = 0.5  # below 1, so actors never starve read tasks on small machines
    num_gpus: float = 0.0
    # custom Ray resources each engine actor asks for (map_batches' `resources`): e.g. one unit
    # of a resource every node has once, for one engine per node (docs/cluster-ray.md)
    resources: Mapping[str, float] | None = None
    # True: rows leave as they finish (exactly once under task retries through the emitted-rows
    # record, docs/guarantees.md); False: each input batch whole, in order; "ordered": one row
    # at a time in input order
    stream: bool | str = True
    # move work between engines (connectors/ray_migration.py); None: on when the pool can
    # hold more than one actor
    migration: bool | None = None
    migration_options: Mapping[str, Any] | None = None  # MigrationOptions fields
    # queued rows (not yet scheduled) may move to an engine with a free seat; None: as migration
    late_binding: bool | None = None
    program: Any = None  # a @batchgen_data.program run on every row (docs/programs.md)
    # resume after a crash: a directory (beside the output, not in it) where Ray Data records
    # the ids of rows written; a rerun skips them before they reach an engine (resume.py)
    resume_from: str | None = None
    id_column: str = "id"  # unique per row, from the read through to the write
    # ray.data.llm's task_type: "generate", or a pooling task "embed" / "classify" / "score"
    # (output columns `embedding` / `probs` / `score`, docs/pooling.md)
    task_type: str = "generate"
    pooling_params: Mapping[str, Any] | None = None  # PoolingParams fields for every row
    # ray.data.llm's: a local directory of LoRA adapters; a row's `model` (or `lora`) names one
    # (needs engine_kwargs enable_lora=True; docs/lora.md)
    dynamic_lora_loading_path: str | None = None
    # ray.data.llm's: the placement group of each tensor-parallel engine actor,
    # {"bundles": [one per rank], "strategy": "PACK"} or {"bundle_per_worker": {...}}; None:
    # one bundle per rank of num_cpus, num_gpus / tensor_parallel_size GPUs and `resources`
    # (connectors/ray_placement.py)
    placement_group_config: Mapping[str, Any] | None = None

    @property
    def all_engine_kwargs(self) -> dict[str, Any]:
        """`engine_kwargs` with the fields of this config that are engine settings; a
        tensor-parallel engine's ranks are Ray actors in its placement group unless
        `distributed_executor_backend` says otherwise (ray.data.llm's default)."""
        kw = dict(self.engine_kwargs)
        if self.dynamic_lora_loading_path is not None:
            kw["dynamic_lora_loading_path"] = self.dynamic_lora_loading_path
        if self.tensor_parallel_size > 1:
            kw.setdefault("distributed_executor_backend", "ray")
        return kw

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine_kwargs.get("tensor_parallel_size", 1)

    @property
    def placement(self) -> tuple[list[dict[str, float]], str] | None:
        """Bundles and strategy of each engine actor's placement group; None: no group (one
        device, or ranks started as processes beside the actor)."""
        backend = self.all_engine_kwargs.get("distributed_executor_backend")
        if self.tensor_parallel_size <= 1 or backend != "ray":
            return None
        return ray_placement.rank_bundles(self.tensor_parallel_size, self.num_cpus,
                                          self.num_gpus, self.resources,
                                          self.placement_group_config)

    @property
    def late_binding_on(self) -> bool:
        return self.migration_on if self.late_binding is None else self.late_binding

    @property
    def concurrent_batches(self) -> int:
        """Input batches one actor serves at once: the field, else from the window depth."""
        if self.max_concurrent_batches is not None:
            return self.max_concurrent_batches
        sched = make_engine_config(self.model_source, **self.all_engine_kwargs).scheduler
        if self.task_type != "generate":
            # a pooled row leaves after one pass: an actor needs the rows of about one step
            # (its token budget at POOLING_ROW_TOKENS a row), not max_num_seqs of them; a
            # wider window let the first actor up take a small job's every batch while the
            # others were still loading (benchmarks/embed_throughput.py --ray-actors 2)
            seats = max(1, sched.max_num_batched_tokens // POOLING_ROW_TOKENS)
            return max(2, window_batches(seats, self.batch_size, self.window_depth))
        return window_batches(sched.max_num_seqs, self.batch_size, self.window_depth)

    @property
    def migration_on(self) -> bool:
        if self.task_type != "generate":
            return False  # a pooling request finishes in one pass: nothing to move
        if self.migration is not None:
            return self.migration
        return (self.concurrency[-1] if isinstance(self.concurrency, tuple) else self.concurrency) > 1

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size!r}: must be an int >= 1")
        sizes = self.concurrency if isinstance(self.concurrency, tuple) else (self.concurrency,)
        if not 1 <= len(sizes) <= 2 or any(not isinstance(s, int) or s < 1 for s in sizes) \
                or sizes[0] > sizes[-1]:
            raise ValueError(f"concurrency={self.concurrency!r}: use n >= 1 or (m, n), 1 <= m <= n")
        if self.max_concurrent_batches is not None and self.max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches={self.max_concurrent_batches!r}: must be >= 1")
        if not self.window_depth > 0:
            raise ValueError(f"window_depth={self.window_depth!r}: must be > 0")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(f"num_cpus={self.num_cpus!r}, num_gpus={self.num_gpus!r}: must be >= 0")
        if self.resources is not None and any(
                not isinstance(v, (int, float)) or v < 0 for v in dict(self.resources).values()):
            raise ValueError(f"resources={self.resources!r}: amounts must be numbers >= 0")
        make_engine_config(self.model_source, **self.all_engine_kwargs)  # TypeError on typos
        _ = self.placement  # ValueError on a group that cannot hold the ranks
        if self.task_type != "generate":
            from batchgen_data.connectors.pooling_rows import check_task, default_pooling_params
            check_task(self.task_type)
            default_pooling_params(self.pooling_params)
        MigrationOptions(**dict(self.migration_options or {}))
        if self.program is not None and not hasattr(self.program, "max_steps"):
            raise TypeError(f"program must be a @batchgen_data.program, got "
                            f"{type(self.program).__name__}")
        row_extras.default_params(self.sampling_params)  # response_format allowed here
        check_template_kwargs(dict(self.chat_template_kwargs or {}))
        if self.resume_from is not None:
            checkpoint_config(self.resume_from, self.id_column)  # a bad path fails here

    def constructor_kwargs(self, job_id: str | None = None) -> dict[str, Any]:
        """`fn_constructor_kwargs` for `BatchGenPredictor`; `job_id` names the coordinator."""
        params = self.sampling_params
        options = {"job_id": job_id, **dict(self.migration_options or {})}
        return dict(model=self.model_source,
                    sampling_params=dict(params) if isinstance(params, Mapping) else params,
                    on_error="row" if self.should_continue_on_error else "raise",
                    stream=self.stream, apply_chat_template=self.apply_chat_template,
                    chat_template=self.chat_template,
                    chat_template_kwargs=dict(self.chat_template_kwargs or {}),
                    migration=self.migration_on, migration_options=options,
                    late_binding=self.late_binding_on,
                    program=self.program, **self.all_engine_kwargs,
                    **({} if self.task_type == "generate" else
                       {"task": self.task_type, "pooling_params": dict(self.pooling_params or {})}))

    def map_batches_kwargs(self, job_id: str | None = None) -> dict[str, Any]:
        """Everything else `Dataset.map_batches` needs to run the predictor."""
        import ray.data

        in_flight = self.max_tasks_in_flight_per_actor
        calls = self.concurrent_batches
        if in_flight is None and (self.migration_on or self.late_binding_on):
            # no batches queued at an actor beyond the ones it serves (where no engine sees
            # them): rows stay unbound until a window has room, and the coordinator moves
            # queued rows that were bound to a busy engine
            in_flight = calls
        elif in_flight is None and self.task_type != "generate":
            in_flight = calls + 1  # one batch queued at hand; the rest go where there is room

        if isinstance(self.concurrency, tuple):
            sizes = dict(min_size=self.concurrency[0], max_size=self.concurrency[1])
        else:
            # fixed, not (1, n): with late binding a pool that may grow makes Ray warn on every
            # job that it can never scale up (tasks in flight per actor / concurrency < 1.75)
            sizes = dict(size=self.concurrency)
        compute = ray.data.ActorPoolStrategy(
            **sizes, max_tasks_in_flight_per_actor=in_flight,
            max_concurrent_calls_per_actor=calls,
            # several __call__s run at once on one actor; the predictor is thread-safe
            enable_true_multi_threading=True)
        kw: dict[str, Any] = dict(batch_size=self.batch_size, batch_format="pyarrow",
                                  compute=compute, num_cpus=self.num_cpus,
                                  fn_constructor_kwargs=self.constructor_kwargs(job_id))
        if self.num_gpus:
            kw["num_gpus"] = self.num_gpus
        if self.resources:
            kw["resources"] = dict(self.resources)
        placement = self.placement
        if placement is not None:  # rank 0 in bundle 0 of a group of its own
            bundles, strategy = placement
            kw.pop("num_gpus", None)
            kw.pop("resources", None)
            kw.update(ray_placement.actor_resources(bundles[0]))
            kw["ray_remote_args_fn"] = ray_placement.remote_args_fn(bundles, strategy)
        if self.accelerator_type is not None:
            kw["accelerator_type"] = self.accelerator_type
        if self.runtime_env is not None:
            kw["runtime_env"] = self.runtime_env
        return kw


POOLING_ROW_TOKENS = 128  # tokens of a pooled row, for sizing an actor's window only
MAX_WINDOW_BATCHES = 128  # each batch in flight is a thread of the actor: keep that bounded


def window_batches(max_num_seqs: int, batch_size: int, depth: float = 2.0) -> int:
    """Input batches an actor must serve at once to keep `depth` x `max_num_seqs` rows in its
    engine: its seats full and a queue behind them. Ray's vLLM stage asks for at least
    ceil(max_num_seqs / batch_size) (depth 1); a batch held by its slowest row then leaves seats
    empty, which the queue of a deeper window fills. At most `MAX_WINDOW_BATCHES` (one thread
    each): with tiny batches the window is then shallower; use larger batches."""
    if max_num_seqs < 1 or batch_size < 1 or not depth > 0:
        raise ValueError(f"window_batches({max_num_seqs!r}, {batch_size!r}, {depth!r}): "
                         "needs max_num_seqs >= 1, batch_size >= 1, depth > 0")
    return min(MAX_WINDOW_BATCHES, max(1, math.ceil(max_num_seqs * depth / batch_size)))


class Processor:
    """`processor(ds) -> ds`: optional preprocess, the predictor, optional postprocess."""

    def __init__(self, config: BatchGenProcessorConfig,
                 preprocess: Callable[[Row], Row] | None = None,
                 postprocess: Callable[[Row], Row] | None = None,
                 preprocess_map_kwargs: dict[str, Any] | None = None,
                 postprocess_map_kwargs: dict[str, Any] | None = None) -> None:
        self.config = config
        self.preprocess = preprocess
        self.postprocess = None if postprocess is None else _VllmFieldsThen(postprocess)
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


# ray.data.llm's vLLM stage (ray/llm/_internal/batch/stages/vllm_engine_stage.py, Ray 2.60:
# vLLMOutputData and the stage's own columns) → this project's column holding the same value;
# None: there is no such value here, so the field is present and null
VLLM_FIELDS: dict[str, str | None] = {
    "generated_tokens": "generated_token_ids", "num_input_tokens": "num_prompt_tokens",
    "prompt": None, "prompt_token_ids": None, "embeddings": "embedding", "metrics": None,
    "logprobs": None, "prompt_logprobs": None, "request_id": None, "batch_uuid": None,
    "time_taken_llm": None, "params": None}


def with_vllm_fields(row: Row) -> Row:
    """`row` plus the fields `ray.data.llm`'s vLLM stage outputs; a field the row already has
    (its input `prompt`, say) is kept as it is."""
    out = dict(row)
    for name, ours in VLLM_FIELDS.items():
        if name not in out:
            out[name] = row.get(ours) if ours is not None else None
    return out


class _VllmFieldsThen:
    """The user's postprocess, called on the row with vLLM's field names added (a class, not a
    closure, so Ray can pickle it by reference)."""

    def __init__(self, fn: Callable[[Row], Row]) -> None:
        self.fn = fn

    def __call__(self, row: Row) -> Row:
        return self.fn(with_vllm_fields(row))


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
                    postprocess_map_kwargs: dict[str, Any] | None = None) -> Processor:
    """Same call shape as `ray.data.llm.build_processor` (without `builder_kwargs`)."""
    if not isinstance(config, BatchGenProcessorConfig):
        raise TypeError(f"config must be BatchGenProcessorConfig, got {type(config).__name__}")
    return Processor(config, preprocess, postprocess, preprocess_map_kwargs,
                     postprocess_map_kwargs)
