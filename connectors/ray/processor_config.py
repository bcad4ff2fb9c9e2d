"""`BatchGenProcessorConfig`: how `build_processor` runs `BatchGenPredictor` over a Dataset.

Field names follow `ray.data.llm.vLLMEngineProcessorConfig` where the idea carries over, and
every field of Ray's config is accepted with its meaning or refused with the reason
(`ray_llm_compat.py`); docs/ray_data.md lists the differences. Building one checks it whole
(engine kwargs, sampling defaults, placement, resume path) before any Ray job starts.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from batchgen_data.inputs.chat import check_template_kwargs
from batchgen_data.config import make_engine_config
from batchgen_data.connectors.ray import placement as ray_placement
from batchgen_data.connectors import row_extras
from batchgen_data.connectors.migration_options import MigrationOptions
from batchgen_data.connectors.ray.llm_compat import check_ray_fields, first_set, stage
from batchgen_data.connectors.resume import checkpoint_config
from batchgen_data.connectors.row_kinds import RowKind
from batchgen_data.sampling_params import SamplingParams


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
    # move work between engines (connectors/ray/migration.py); None: on when the pool can
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
    # (connectors/ray/placement.py)
    placement_group_config: Mapping[str, Any] | None = None
    # ray.data.llm's: at most this many rows in an engine at once (None: the window decides)
    max_pending_requests: int | None = None
    # ray.data.llm's stage switches: a bool, a dict or Ray's *StageConfig; None: not given
    # (then apply_chat_template / chat_template, and tokenize / detokenize, decide);
    # connectors/ray/llm_compat.py says what each means here
    chat_template_stage: Any = None
    tokenize_stage: Any = None
    detokenize_stage: Any = None
    prepare_multimodal_stage: Any = False  # on or off: images are prepared either way
    tokenize: bool | None = None  # Ray's deprecated flags for the two stages above
    detokenize: bool | None = None
    log_engine_metrics: bool = True  # True only: statistics are always exported (REFUSED)
    has_image: Any = None  # removed from ray.data.llm: refused when given
    prepare_image_stage: Any = None

    @property
    def chat_template_on(self) -> bool:
        """Messages (and a plain prompt) through the chat template: Ray's stage switch when
        given, else `apply_chat_template`."""
        if self.chat_template_stage is None:
            return self.apply_chat_template
        return stage("chat_template_stage", self.chat_template_stage, self.model_source).enabled

    @property
    def template_options(self) -> tuple[str | None, dict[str, Any]]:
        """The chat template and its kwargs: the stage config's when it sets them."""
        opts = ({} if self.chat_template_stage is None else
                stage("chat_template_stage", self.chat_template_stage, self.model_source).options)
        return (first_set(opts.get("chat_template"), self.chat_template, default=None),
                dict(first_set(opts.get("chat_template_kwargs"), self.chat_template_kwargs,
                               default={})))

    @property
    def detokenize_on(self) -> bool:
        """Ray's detokenize stage (on by default): every row gets its text."""
        value = first_set(self.detokenize_stage, self.detokenize, default=True)
        return stage("detokenize_stage", value, self.model_source).enabled

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
        if self.max_pending_requests is not None:  # whole batches, at least one
            return max(1, self.max_pending_requests // self.batch_size)
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
        if self.max_pending_requests is not None and (
                not isinstance(self.max_pending_requests, int) or self.max_pending_requests < 1):
            raise ValueError(f"max_pending_requests={self.max_pending_requests!r}: must be an "
                             "int >= 1")
        check_ray_fields(self)
        make_engine_config(self.model_source, **self.all_engine_kwargs)  # TypeError on typos
        _ = self.placement  # ValueError on a group that cannot hold the ranks
        # the rows' kind: task, pooling defaults and program checked as the actors will
        RowKind.create(self.task_type, None, self.program, self.pooling_params)
        MigrationOptions(**dict(self.migration_options or {}))
        row_extras.default_params(self.sampling_params)  # response_format allowed here
        check_template_kwargs(self.template_options[1])
        if self.resume_from is not None:
            checkpoint_config(self.resume_from, self.id_column)  # a bad path fails here

    def constructor_kwargs(self, job_id: str | None = None) -> dict[str, Any]:
        """`fn_constructor_kwargs` for `BatchGenPredictor`; `job_id` names the coordinator."""
        params = self.sampling_params
        if isinstance(params, Mapping) and self.detokenize_on and params.get("detokenize") is False:
            # Ray's detokenize stage would give every row its text anyway (ray_llm_compat.py)
            params = {k: v for k, v in params.items() if k != "detokenize"}
        options = {"job_id": job_id, **dict(self.migration_options or {})}
        return dict(model=self.model_source,
                    sampling_params=dict(params) if isinstance(params, Mapping) else params,
                    on_error="row" if self.should_continue_on_error else "raise",
                    stream=self.stream, apply_chat_template=self.chat_template_on,
                    chat_template=self.template_options[0],
                    chat_template_kwargs=self.template_options[1],
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
