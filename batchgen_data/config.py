"""Engine configuration: one frozen dataclass per concern, validated on construction.

`make_engine_config` is the single place that turns user kwargs (vLLM names where they exist)
into configs; an unknown kwarg raises TypeError listing the valid names. vLLM's other common
engine arguments are mapped, accepted or refused first (`engine_args`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from batchgen_data.reasoning.registry import check_reasoning_parser
from batchgen_data.reasoning.tools import tool_parser

_DTYPES = ("auto", "float32", "float16", "bfloat16")
# vLLM's names of the checkpoint methods that load (models/quant_config.py)
# vLLM's kv_cache_dtype names this engine honours: the model's dtype, or an e4m3 cache with
# per-layer scales (layers/kv_quant.py; vLLM's "fp8" is e4m3 too)
_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
_QUANTIZATION = ("compressed-tensors", "compressed_tensors", "fp8", "fbgemm_fp8", "gptq",
                 "gptq_marlin", "marlin", "awq", "awq_marlin")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # KV memory on the device (CPU: bytes of host RAM used as "device" KV). None: derive.
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None  # exact override (tests use it to force preemption)
    gpu_memory_utilization: float = 0.85
    # Host memory for the KV of held (and preempted) sequences, copied out of the cache (vLLM's
    # swap space, `core/kv/held_kv.py`); beyond it, held sequences are recomputed on resume.
    held_kv_bytes: int = 4 << 30
    # Host memory for running sequences' KV (the KV host tier of module-based batching,
    # docs/offload.md): steps grow past what the device KV holds. 0: off.
    host_kv_tier_bytes: int = 0
    # vLLM's name: "auto" keeps K/V in the model's dtype; "fp8" (= "fp8_e4m3") stores them as
    # float8_e4m3fn with per-layer scales, half a bf16 cache's bytes (docs/quantization.md)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype is None:  # vLLM configs may carry None for "auto"
            object.__setattr__(self, "kv_cache_dtype", "auto")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            why = (" (only e4m3 is implemented)" if self.kv_cache_dtype == "fp8_e5m2" else "")
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: use one of "
                             f"{_KV_CACHE_DTYPES}{why} (docs/quantization.md)")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size!r}: must be a power of two >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks!r}: must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r}: must be in (0, 1]")
        if self.held_kv_bytes < 0:
            raise ValueError(f"held_kv_bytes={self.held_kv_bytes!r}: must be >= 0")
        if self.host_kv_tier_bytes < 0:
            raise ValueError(f"host_kv_tier_bytes={self.host_kv_tier_bytes!r}: must be >= 0")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # "auto": keep KV in host memory when the tier has room, else recompute on resume.
    preemption_mode: str = "auto"
    # MoE models: mean tokens per expert one step may give (None: only max_num_batched_tokens
    # bounds the step; see docs/moe.md). Dense models ignore it.
    max_tokens_per_expert: int | None = None
    # vLLM's names: the image embedding rows one step's encoder batch may compute (None:
    # max_num_batched_tokens; an image larger still runs, alone in its step), and the rows
    # the engine keeps encoded images in, by content hash (None: 16 times that budget)
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs!r}: must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens!r}: must be >= 1")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption_mode={self.preemption_mode!r}: use auto, swap or recompute")
        if self.max_tokens_per_expert is not None and self.max_tokens_per_expert < 1:
            raise ValueError(f"max_tokens_per_expert={self.max_tokens_per_expert!r}: must be >= 1")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name}={value!r}: must be an int >= 1")

    @property
    def encoder_budget(self) -> int:
        """Image embedding rows one step's encoder batch may compute."""
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens

    @property
    def encoder_cache_rows(self) -> int:
        return self.encoder_cache_size or 16 * self.encoder_budget


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """LoRA adapters chosen per request (vLLM's names; docs/lora.md)."""

    enable_lora: bool = False
    max_loras: int = 1  # adapters resident in device memory at once (one step's distinct ones)
    max_lora_rank: int = 16  # adapters of a higher rank are refused
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: max(max_loras, 8))
    # ray.data.llm's name: the local directory whose subdirectories are the adapters rows name
    # (a `lora` column, or a row's `model`; lora_request.AdapterNames)
    dynamic_lora_loading_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise TypeError(f"enable_lora={self.enable_lora!r}: must be True or False")
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) \
                or self.max_loras < 1:
            raise ValueError(f"max_loras={self.max_loras!r}: must be an int >= 1")
        if isinstance(self.max_lora_rank, bool) or not isinstance(self.max_lora_rank, int) \
                or not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank={self.max_lora_rank!r}: must be an int in [1, 512]")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras!r}: must be >= max_loras "
                             f"({self.max_loras})")

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras or max(self.max_loras, 8)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None
    tokenizer: str | None = None
    max_model_len: int | None = None  # None: the model's own limit
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    trust_remote_code: bool = False
    enforce_eager: bool = False
    # vLLM's name: schedule and prepare step n+1 while step n runs on the device (on a worker
    # thread), so the device does not wait for the host between steps (docs/step.md)
    async_scheduling: bool = False
    num_threads: int | None = None  # torch intra-op threads on the CPU (None: leave as is)
    # CPU: the compiled C kernels and packed weight layouts where they run (False: torch only)
    cpu_kernels: bool = True
    # MoE models: run attention in micro-batches of this many sequences while each MoE layer
    # still takes the whole step's tokens (None: one attention batch; see docs/moe.md)
    attention_micro_batch_seqs: int | None = None
    # GiB of weights kept in host memory and streamed to the device (vLLM's name): the device
    # holds at most the weights minus this, streaming workspace included (docs/offload.md)
    cpu_offload_gb: float = 0.0
    # an absolute cap on the device's weight bytes (streaming workspace included); None: no cap
    weight_memory_bytes: int | None = None
    # streamed MoE layers copy in only the experts a step routes to (False: whole layers)
    stream_experts: bool = True
    # vLLM's name: the quantization method the user expects; the checkpoint's own
    # quantization_config decides the format and this is checked against it when the model
    # loads (None: whatever the checkpoint says; docs/quantization.md)
    quantization: str | None = None
    # vLLM's name: ranks over torch.distributed, one process per device, the model's weights
    # and KV heads split between them (docs/parallel.md); Llama-family decoders and their MoE
    # models
    tensor_parallel_size: int = 1
    # rank 0 waits at most this long on any collective: a dead or stuck rank fails the engine
    collective_timeout_s: float = 120.0
    # vLLM's name: how ranks 1.. start: "mp" (None): processes on this node; "ray": Ray actors
    # in the bundles of the placement group this engine runs in, on any node; "uni" (one
    # device: no other rank; ray.data.llm's default then) (docs/parallel.md)
    distributed_executor_backend: str | None = None
    # the CUDA device of each rank ("mp": processes on this node), e.g. (3, 5) for the two GPUs
    # a Spark task holds; None: rank r on the index of `device` plus r (cuda:0, 1, ... unless
    # `device` names another first)
    rank_devices: tuple[int, ...] | None = None
    # vLLM's name: MoE layers keep whole experts per rank instead of a slice of each (one
    # rank: nothing to split; docs/parallel.md)
    enable_expert_parallel: bool = False
    # vLLM's name: the most logprobs (and prompt_logprobs) one request may ask for per token;
    # -1: the vocabulary. A request asking more is refused when it enters (engine/limits.py)
    max_logprobs: int = 20
    # vLLM's name: split each output's reasoning from its answer with this parser
    # (batchgen_data/reasoning/: "deepseek_r1", "qwen3"; docs/reasoning.md); None: no split
    reasoning_parser: str | None = None
    # vLLM's name: the text a thinking budget appends to end a row's reasoning (it must hold
    # the parser's closing tag); None: the parser's default, Qwen's documented sentence
    reasoning_end_str: str | None = None
    # vLLM's name: read tool calls out of every answer with this parser ("hermes",
    # "llama3_json", "mistral", "pythonic"; docs/reasoning.md); None: answers stay text
    tool_call_parser: str | None = None
    # no row reasons longer than this quantile of the reasoning lengths of the rows that ended
    # theirs so far (0.95: the p95), once 16 have; the end of thinking is appended as a
    # budget does (core/thinking.py; docs/reasoning.md). None: no job cap
    thinking_cap_quantile: float | None = None
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    lora: LoRAConfig = LoRAConfig()
    # the engine arguments the user gave (`make_engine_config` records them): a value the
    # engine resolves for itself (offload's step caps, engine/setup.py) is never changed when
    # given, whatever it is, a default's value included
    given: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.given, frozenset):
            object.__setattr__(self, "given", frozenset(self.given))
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be one of {_DTYPES}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len!r}: must be >= 2")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads={self.num_threads!r}: must be >= 1")
        if self.attention_micro_batch_seqs is not None and self.attention_micro_batch_seqs < 1:
            raise ValueError(f"attention_micro_batch_seqs={self.attention_micro_batch_seqs!r}: "
                             "must be >= 1")
        if not isinstance(self.async_scheduling, bool):
            raise TypeError(f"async_scheduling={self.async_scheduling!r}: must be True or False")
        if not isinstance(self.cpu_kernels, bool):
            raise TypeError(f"cpu_kernels={self.cpu_kernels!r}: must be True or False")
        if not isinstance(self.cpu_offload_gb, (int, float)) or self.cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb={self.cpu_offload_gb!r}: must be a number >= 0")
        if not isinstance(self.stream_experts, bool):
            raise TypeError(f"stream_experts={self.stream_experts!r}: must be True or False")
        if self.weight_memory_bytes is not None and self.weight_memory_bytes < 1:
            raise ValueError(f"weight_memory_bytes={self.weight_memory_bytes!r}: must be >= 1")
        if self.quantization is not None and self.quantization not in _QUANTIZATION:
            raise ValueError(f"quantization={self.quantization!r}: quantized checkpoints of "
                             f"this method are not supported; supported: {_QUANTIZATION} (the "
                             "checkpoint's quantization_config decides; docs/quantization.md)")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) \
                or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs={self.max_logprobs!r}: must be an int >= 0, or -1 "
                             "for the vocabulary size")
        check_reasoning_parser(self.reasoning_parser)
        if self.tool_call_parser is not None:
            tool_parser(self.tool_call_parser)  # ValueError listing the valid names
        q = self.thinking_cap_quantile
        if q is not None and (isinstance(q, bool) or not isinstance(q, (int, float))
                              or not 0 < q <= 1):
            raise ValueError(f"thinking_cap_quantile={q!r}: a quantile in (0, 1], e.g. 0.95")
        self._check_parallel()
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r}: use auto, cpu or cuda[:N]")


    def _check_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size={tp!r}: must be an int >= 1")
        if not isinstance(self.collective_timeout_s, (int, float)) or \
                self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s={self.collective_timeout_s!r}: must be > 0")
        if not isinstance(self.enable_expert_parallel, bool):
            raise TypeError(f"enable_expert_parallel={self.enable_expert_parallel!r}: must be "
                            "True or False")
        self._check_rank_devices(tp)
        backend = self.distributed_executor_backend
        if backend not in (None, "mp", "ray", "uni") or (backend == "uni" and tp > 1):
            raise ValueError(f"distributed_executor_backend={backend!r} with tensor_parallel_size"
                             f"={tp}: use 'mp' (processes on this node) or 'ray' (Ray actors in "
                             "this engine's placement group); 'uni' for one device only")
        if tp == 1:
            return
        together = {"cpu_offload_gb": (self.cpu_offload_gb, self.cpu_offload_gb > 0),
                    "weight_memory_bytes": (self.weight_memory_bytes,
                                            self.weight_memory_bytes is not None),
                    "host_kv_tier_bytes": (self.cache.host_kv_tier_bytes,
                                           self.cache.host_kv_tier_bytes > 0),
                    "attention_micro_batch_seqs": (self.attention_micro_batch_seqs,
                                                   self.attention_micro_batch_seqs is not None)}
        for name, (value, used) in together.items():
            if used:
                raise ValueError(f"tensor_parallel_size={tp} with {name}={value!r}: not "
                                 "supported together yet (docs/parallel.md)")

    def _check_rank_devices(self, tp: int) -> None:
        devs = self.rank_devices
        if devs is None:
            return
        if not isinstance(devs, (list, tuple)) or any(
                not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in devs):
            raise ValueError(f"rank_devices={devs!r}: a CUDA device index (int >= 0) per rank")
        if len(devs) != tp or len(set(devs)) != len(devs):
            raise ValueError(f"rank_devices={devs!r}: {tp} distinct devices, one per rank "
                             f"(tensor_parallel_size={tp})")
        if self.device == "cpu" or self.distributed_executor_backend == "ray":
            raise ValueError(f"rank_devices={devs!r}: CUDA ranks started on this node only "
                             f"(device={self.device!r}, distributed_executor_backend="
                             f"{self.distributed_executor_backend!r}; a Ray rank uses the GPU "
                             "of its bundle)")
        object.__setattr__(self, "rank_devices", tuple(devs))


_SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "lora": LoRAConfig}


def engine_kwarg_names() -> list[str]:
    names = [f.name for f in fields(EngineConfig) if f.name not in (*_SECTIONS, "given")]
    for cls in _SECTIONS.values():
        names += [f.name for f in fields(cls)]
    return sorted(names)


def make_engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """Split flat user kwargs into the config sections; unknown names raise TypeError."""
    from batchgen_data.engine_args import translate_vllm_args, vllm_arg_names

    if "host_kv_cache_bytes" in kwargs:
        raise TypeError("host_kv_cache_bytes is now held_kv_bytes (host memory for held "
                        "sequences' KV; host_kv_tier_bytes is the KV host tier of running ones)")
    kwargs = translate_vllm_args(kwargs, set(engine_kwarg_names()))
    unknown = sorted(set(kwargs) - set(engine_kwarg_names()))
    if unknown:
        raise TypeError(f"unknown engine argument(s) {unknown}; valid: {engine_kwarg_names()}, "
                        f"and vLLM's {vllm_arg_names()} (batchgen_data/engine_args.py)")
    given = frozenset(kwargs)
    sections = {}
    for key, cls in _SECTIONS.items():
        own = {f.name for f in fields(cls)}
        sections[key] = cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in own})
    return EngineConfig(model=model, **kwargs, **sections, given=given)
