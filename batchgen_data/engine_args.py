"""vLLM's engine arguments, for users who bring a vLLM or `ray.data.llm` configuration.

`translate_vllm_args` runs before `make_engine_config` checks names. Each vLLM argument that is
not already one of this engine's own is
  * **mapped** onto the equivalent here (`swap_space` GiB → `held_kv_bytes`,
    `num_gpu_blocks_override` → `num_kv_blocks`);
  * **accepted** when its value describes what this engine always does (`enable_chunked_prefill=
    True`: prompts are always computed in chunks under `max_num_batched_tokens`;
    `disable_log_stats`: there is no periodic stats log), with no effect;
  * **refused** with a ValueError that says why and what to do instead, when this engine cannot
    honour the value (`pipeline_parallel_size=2`, `calculate_kv_scales=True`, ...).
So Ray's quickstart shape, `engine_kwargs={"enable_chunked_prefill": True,
"max_num_batched_tokens": 4096, "max_model_len": 16384}`, works as it is.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_ONE_DEVICE = ("an engine spans devices only by tensor_parallel_size (dense models, "
               "docs/parallel.md); to use more GPUs otherwise, run more engines "
               "(Ray actors: `concurrency`; the command: --actors)")


@dataclass(frozen=True)
class _Arg:
    ok: Callable[[Any], bool]  # the values this engine honours
    why: str  # what it does instead, said when a value is refused
    target: str | None = None  # the engine's own name, for a mapped argument
    convert: Callable[[Any], Any] = lambda v: v


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(v == x and type(v) is type(x) for x in values)


def _any(_: Any) -> bool:
    return True


def _positive_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


VLLM_ARGS: dict[str, _Arg] = {
    # mapped onto this engine's own arguments
    "swap_space": _Arg(_positive_number, "GiB of host memory for preempted sequences' KV",
                       "held_kv_bytes", lambda gib: int(gib * (1 << 30))),
    "num_gpu_blocks_override": _Arg(lambda v: isinstance(v, int) and v >= 1,
                                    "must be an int >= 1", "num_kv_blocks"),
    # what this engine always does: accepted, no effect
    "enable_chunked_prefill": _Arg(_is(True, None), "this engine always computes prompts in "
                                   "chunks under max_num_batched_tokens; it cannot turn that off"),
    "disable_log_stats": _Arg(_any, "statistics are in engine.stats, never logged periodically"),
    "disable_log_requests": _Arg(_any, "requests are never logged"),
    "enable_log_requests": _Arg(_is(False, None), "requests are never logged"),
    "pipeline_parallel_size": _Arg(_is(1, None), _ONE_DEVICE),
    "data_parallel_size": _Arg(_is(1, None), _ONE_DEVICE + "; `LLM(data_parallel_size=N)` "
                               "runs N engines on this machine as one group"),
    "disable_custom_all_reduce": _Arg(_any, "the all-reduce is torch.distributed's (gloo on the "
                                            "CPU, NCCL on CUDA)"),
    "max_seq_len_to_capture": _Arg(_any, "CUDA graphs cover every decode batch size"),
    "compilation_config": _Arg(_any, "the engine picks its own fast paths (enforce_eager=True "
                                     "turns CUDA graphs off)"),
    "disable_async_output_proc": _Arg(_any, "outputs are processed on the engine thread"),
    "scheduling_policy": _Arg(_is("fcfs", None), "requests are served first come, first served"),
    "tokenizer_mode": _Arg(_is("auto", None), "the model's fast tokenizer is always used"),
    "load_format": _Arg(_is("auto", "safetensors", None),
                        "weights load from *.safetensors (or the embedded GGUF model)"),
    "calculate_kv_scales": _Arg(_is(False, None), "FP8 KV scales are the checkpoint's "
                                "(k_scale / v_scale), else 1.0; they are never computed from "
                                "the first batch (docs/quantization.md)"),
    # the front doors' image pipeline reads these from the same kwargs (inputs/image_options.py)
    "limit_mm_per_prompt": _Arg(_any, "read by the inputs pipeline, not the engine"),
    "mm_processor_kwargs": _Arg(_any, "read by the inputs pipeline, not the engine"),
    "allowed_local_media_path": _Arg(_any, "read by the inputs pipeline, not the engine"),
    "revision": _Arg(_is(None), "nothing is downloaded: pass a local directory"),
    "tokenizer_revision": _Arg(_is(None), "nothing is downloaded: pass a local directory"),
    "code_revision": _Arg(_is(None), "nothing is downloaded: pass a local directory"),
    "download_dir": _Arg(_is(None), "nothing is downloaded: pass a local directory"),
    "served_model_name": _Arg(_any, "a name for outputs only"),
    "disable_sliding_window": _Arg(_any, "a model's sliding windows are always applied as "
                                         "its config sets them"),
    "guided_decoding_backend": _Arg(_any, "structured output picks its own grammar engine"),
    "structured_outputs_config": _Arg(_any, "structured output picks its own grammar engine"),
    "logprobs_mode": _Arg(_is("raw_logprobs", None), "logprobs are the raw model's "
                          "log-probabilities (vLLM's default, raw_logprobs); raw logits and the "
                          "processed modes (after temperature, penalties, top-k/p) are not "
                          "computed"),
    "config_format": _Arg(_is("auto", "hf", None), "the model's config.json (Hugging Face "
                          "format) is read; Mistral's params.json is not"),
    "speculative_config": _Arg(_is(None), "speculative decoding is not supported"),
    "generation_config": _Arg(_is("vllm", None), "sampling defaults are vLLM's own "
                              "(SamplingParams()); a model's generation_config.json is not read"),
}


def vllm_arg_names() -> list[str]:
    return sorted(VLLM_ARGS)


def translate_vllm_args(kwargs: dict[str, Any], own: set[str]) -> dict[str, Any]:
    """`kwargs` with vLLM's names mapped or dropped (see the module docstring); names in `own`
    (this engine's arguments) and unknown names pass through for the caller to judge."""
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        arg = VLLM_ARGS.get(name)
        if name in own or arg is None:
            out[name] = value
            continue
        if not arg.ok(value):
            raise ValueError(f"engine argument {name}={value!r} is not supported: {arg.why}")
        if arg.target is not None:
            if arg.target in kwargs:
                raise TypeError(f"engine arguments {name} and {arg.target} are the same "
                                "setting; give one")
            out[arg.target] = arg.convert(value)
    return out
