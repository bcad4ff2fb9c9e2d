"""What a `ray.data.llm` job brings to `build_processor`, and what it means here.

Ray's processor is a chain of stages (chat template → tokenize → vLLM → detokenize) between a
preprocess and a postprocess; here templating, tokenization and detokenization run inside the
engine actor. So:

* a preprocess's output is **merged** into its row, as Ray's `wrap_preprocess` merges it
  (`MergedPreprocess`): the input columns stay, and a postprocess may read `row["id"]`;
* the stage switches (`chat_template_stage`, `tokenize_stage`, `detokenize_stage`,
  `prepare_multimodal_stage`: a bool, a dict or Ray's own `*StageConfig`) and Ray's deprecated
  flags (`apply_chat_template`, `chat_template`, `tokenize`, `detokenize`) are read by
  `stage`: the chat template switch and its template are honoured; the tokenizer stages have
  nothing to switch (the engine tokenizes either way and Ray's detokenize stage decodes the
  same tokens), except that with detokenization on a `detokenize: False` that a preprocess puts
  in a row's sampling_params no longer empties its text, as Ray's stage would decode it; the
  per-stage resources (`batch_size`, `concurrency`, `num_cpus`, `memory`, `runtime_env`) size
  no stage here and are accepted as such; `prepare_multimodal_stage` is accepted either way
  (a row's image parts and image column are prepared in the engine actor's image pipeline,
  inputs/images.py, on or off); a stage tokenizer other than the model's is refused with the
  reason;
* the postprocess sees the field names of Ray's vLLM stage output (`with_vllm_fields`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Row = dict[str, Any]

# fields of Ray's _StageConfigBase: they size a separate Ray Data stage, which does not exist
# here (the work runs in the engine actor), so they are accepted and change nothing
STAGE_RESOURCES = frozenset({"enabled", "batch_size", "concurrency", "runtime_env", "num_cpus",
                             "memory"})
STAGE_FIELDS = {"chat_template_stage": {"chat_template", "chat_template_kwargs", "model_source"},
                "tokenize_stage": {"model_source"}, "detokenize_stage": {"model_source"},
                "prepare_multimodal_stage": {"model_config_kwargs",
                                             "chat_template_content_format",
                                             "apply_sys_msg_formatting"}}
# Ray's fields that this connector refuses, and why
REFUSED = {"has_image": "removed from ray.data.llm (prepare_multimodal_stage replaced it; "
                        "image parts in messages need no switch here)",
           "prepare_image_stage": "removed from ray.data.llm (prepare_multimodal_stage "
                                  "replaced it; image parts in messages need no switch here)",
           "log_engine_metrics": "engine statistics are always exported through "
                                 "ray.util.metrics here (connectors/ray/metrics.py; the "
                                 "command's report reads them); leave it True"}
# build_processor's builder_kwargs that the vLLM builder takes
BUILDER_KWARGS = ("chat_template_kwargs",)


@dataclass(frozen=True)
class Stage:
    """One of Ray's stage switches, resolved: on or off, and its fields that were set."""

    enabled: bool
    options: Mapping[str, Any]


def stage(name: str, value: Any, model_source: str | None) -> Stage:
    """`value` (bool | dict | Ray's `*StageConfig`) as a `Stage`; ValueError/TypeError naming
    `name` for what cannot be honoured here."""
    if isinstance(value, bool):
        return Stage(value, {})
    if hasattr(value, "model_dump"):  # ray.data.llm's typed stage config (pydantic)
        value = value.model_dump()
    if not isinstance(value, Mapping):
        raise TypeError(f"{name}={value!r}: use a bool, a dict or ray.data.llm's stage config")
    options = {k: v for k, v in value.items() if v is not None}
    unknown = sorted(set(options) - STAGE_RESOURCES - STAGE_FIELDS[name])
    if unknown:
        raise ValueError(f"{name}: unknown field(s) {unknown}; valid: "
                         f"{sorted(STAGE_RESOURCES | STAGE_FIELDS[name])}")
    source = options.get("model_source")
    if source is not None and source != model_source:
        raise ValueError(f"{name}.model_source={source!r}: the engine tokenizes with its own "
                         f"model's tokenizer ({model_source!r}); pass another tokenizer as "
                         "engine_kwargs={'tokenizer': ...}")
    return Stage(bool(options.get("enabled", True)), options)


def first_set(*values: Any, default: Any) -> Any:
    """The first value that is not None: an explicit stage config before a legacy flag."""
    return next((v for v in values if v is not None), default)


def check_ray_fields(config: Any) -> None:
    """ValueError/TypeError for the ray.data.llm fields of a `BatchGenProcessorConfig` that
    cannot mean here what they mean there, naming the field and the reason."""
    for name in ("has_image", "prepare_image_stage"):
        if getattr(config, name) is not None:
            raise ValueError(f"{name}: {REFUSED[name]}")
    stage("prepare_multimodal_stage", config.prepare_multimodal_stage, config.model_source)
    if config.log_engine_metrics is not True:
        raise ValueError(f"log_engine_metrics={config.log_engine_metrics!r}: "
                         f"{REFUSED['log_engine_metrics']}")
    for name in ("tokenize", "detokenize"):
        flag = getattr(config, name)
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"{name}={flag!r}: must be True or False")
    stage("tokenize_stage", first_set(config.tokenize_stage, config.tokenize, default=True),
          config.model_source)
    _ = config.detokenize_on, config.chat_template_on, config.template_options


class MergedPreprocess:
    """The user's preprocess, its output merged into the row as Ray merges it (a class, not a
    closure, so Ray can pickle it by reference). With `detokenize` (Ray's detokenize stage
    on), a `detokenize: False` in the row's sampling_params is dropped: Ray's stage would
    decode the tokens anyway, and here the engine's own detokenization is that stage."""

    def __init__(self, fn: Callable[[Row], Row], detokenize: bool = True) -> None:
        self.fn = fn
        self.detokenize = detokenize

    def __call__(self, row: Row) -> Row:
        out = self.fn(row)
        if not isinstance(out, Mapping):
            raise TypeError(f"preprocess must return a dict (merged into the row), got "
                            f"{type(out).__name__}")
        merged = {**row, **out}
        params = merged.get("sampling_params")
        if self.detokenize and isinstance(params, Mapping) and params.get("detokenize") is False:
            merged["sampling_params"] = {k: v for k, v in params.items() if k != "detokenize"}
        return merged


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


class VllmFieldsThen:
    """The user's postprocess, called on the row with vLLM's field names added (a class, not a
    closure, so Ray can pickle it by reference)."""

    def __init__(self, fn: Callable[[Row], Row]) -> None:
        self.fn = fn

    def __call__(self, row: Row) -> Row:
        return self.fn(with_vllm_fields(row))
