"""Build an engine's parts from its config: device, model, tokenizer, KV cache sizing."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchgen_data.config import CacheConfig, EngineConfig, SchedulerConfig
from batchgen_data.worker.devices import pick_device, resolve_device
from batchgen_data.worker.tp.launch import RankGroup
from batchgen_data.worker.tp import runner as tp_runner
from batchgen_data.worker.model_runner import ModelRunner
from batchgen_data.worker.runner import Runner
from batchgen_data.core.stop import StopChecker
from batchgen_data.sample.sampler import Sampler
from batchgen_data.core.kv.block_pool import BlockPool
from batchgen_data.core.kv.held_kv import HeldKVStore
from batchgen_data.layers import long_rope, parallel
from batchgen_data.layers.backend import LayerBackend
from batchgen_data.models import loader
from batchgen_data.models.quant_formats import QuantPlan

# Default cap on the KV cache in host RAM on the CPU (below it, the cache holds every sequence
# at full length). 512 MiB holds ~11.6k tokens of SmolLM2-135M (46 KB a token in fp32), which
# keeps a default engine of that model near 1.5 GiB; raise `kv_cache_memory_bytes` for more.
_CPU_KV_BYTES = 512 << 20
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineParts:
    """What an engine runs (`Engine(config, parts)`): built from the config here, or by the
    caller around a runner of its own (worker/runner.py: the lab's emulated runner, a
    benchmark's stub, a test's fake)."""

    model: Any  # the torch module; the engine reads its `shape` (and `moe`) only
    tokenizer: Any
    device: torch.device
    max_model_len: int
    pool: BlockPool
    held_kv: HeldKVStore  # the KV of held sequences, copied out (swap space)
    runner: Runner
    stopper: StopChecker
    # the scheduler caps the engine runs with, resolved once (offload raises the ones the
    # user did not set: module batching); None: the config's own
    scheduler_config: SchedulerConfig | None = None
    sampler: Sampler | None = None  # None: the engine's own


def pick_dtype(dtype: str, device: torch.device, config: Any) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32  # CPU kernels are fastest and exact in fp32
    native = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
    native = getattr(native, "__str__", lambda: "")().replace("torch.", "")
    return torch.float16 if native == "float16" else torch.bfloat16


def eos_token_ids(path: Path, tokenizer: Any, hf_config: Any) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(hf_config, "eos_token_id", None)):
        ids |= set(src) if isinstance(src, (list, tuple)) else ({src} if src is not None else set())
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    return ids


@dataclass
class Checkpoint:
    """What every engine reads first (`open_checkpoint`): where the model is, its HF config,
    its tokenizer, and the device and dtype it runs in."""

    path: Path
    hf_config: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype


def open_checkpoint(config: EngineConfig, hf_overrides: dict[str, Any] | None = None
                    ) -> Checkpoint:
    """torch's CPU threads set, the device picked, the checkpoint's config read (vLLM's
    `hf_overrides` applied: HF config fields to replace) with its tokenizer, the dtype chosen."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(pick_device(config.device))
    path = loader.resolve_model_path(config.model)
    hf_config = loader.load_config(path, config.trust_remote_code)
    for key, value in (hf_overrides or {}).items():
        setattr(hf_config, key, value)
    tok_path = loader.resolve_model_path(config.tokenizer) if config.tokenizer else path
    tokenizer = loader.load_tokenizer(tok_path, config.trust_remote_code)
    return Checkpoint(path, hf_config, tokenizer, device, pick_dtype(config.dtype, device,
                                                                      hf_config))


def build_parts(config: EngineConfig, ranks: RankGroup | None = None,
                triton: bool | None = None) -> EngineParts:
    """`ranks`: this process's place in a tensor-parallel engine (rank > 0 passes its own;
    rank 0 starts them here when `tensor_parallel_size > 1`). `triton`: the layers' kernels
    (`LayerBackend.choose`: None picks them for the device; True builds for the Triton kernels
    on the CPU too, which tests check the kernel path with)."""
    ck = open_checkpoint(config)
    path, hf_config, tokenizer, device, dtype = (ck.path, ck.hf_config, ck.tokenizer,
                                                 ck.device, ck.dtype)
    plan = quantization_plan(path, hf_config, config.quantization)  # checked before building
    if plan is not None and offload_requested(config) and config.stream_experts \
            and any(".experts." in m for m in plan.modules):
        raise ValueError("quantized MoE experts do not stream per expert (their scales would "
                         "have to move with the codes): pass stream_experts=False to stream "
                         "whole layers")
    if config.tensor_parallel_size > 1:  # checked, then ranks 1.. start (worker/tp/runner.py)
        ranks = ranks or tp_runner.start_ranks(config, hf_config, plan is not None, device)
        device = tp_runner.rank_device(device, ranks.rank, ranks.device_index,
                                       config.rank_devices)
    elif config.rank_devices is not None:  # one rank: its listed device
        device = tp_runner.rank_device(device, 0, None, config.rank_devices)
    tp = ranks.tp if ranks is not None else parallel.current()
    backend = LayerBackend.choose(device, dtype, config.cpu_kernels, _head_dim(hf_config),
                                  config.cache.kv_cache_dtype, triton)
    offload = config.cpu_offload_gb > 0 or config.weight_memory_bytes is not None
    if offload and backend.linear == "onednn":  # opaque tensors cannot stream byte for byte
        backend = dataclasses.replace(backend, linear="plain")
    # streamed weights must never all sit on the device: build and load on the host, then the
    # weight store moves what stays resident (batchgen_data/offload)
    # this rank's shard (layers/parallel.py); the longest sequence (LongRoPE's factors)
    with parallel.sharding(tp), long_rope.context_length(config.max_model_len):
        model = loader.build_model(hf_config, dtype,
                                   torch.device("cpu") if offload else device, backend, plan)
    loader.load_weights(model, path, plan)  # each weight lands in its kernels' layout, once
    sc = config.scheduler
    store = None
    if offload:
        from batchgen_data.worker.offload import offload_model, scheduler_for
        streamed = offload_model(model, config.cpu_offload_gb, device, hf_config,
                                 config.weight_memory_bytes, stream_experts=config.stream_experts)
        if streamed is not None:
            store, plan = streamed
            sc = scheduler_for(sc, plan, config.given)

    max_len, pool, host, runner = runner_parts(config, model, backend, device, sc, ranks,
                                               store)
    stopper = StopChecker(tokenizer, eos_token_ids(path, tokenizer, hf_config))
    return EngineParts(model, tokenizer, device, max_len, pool, host, runner, stopper, sc)


def runner_parts(config: EngineConfig, model: torch.nn.Module, backend: LayerBackend,
                 device: torch.device, sc: SchedulerConfig, ranks: RankGroup | None = None,
                 store: Any = None, blocks_key: str = "num_kv_blocks",
                 limit_s: float | None = None
                 ) -> tuple[int, BlockPool, HeldKVStore, ModelRunner]:
    """What runs a loaded `model` (this rank's shard when `ranks`): the longest sequence, the
    block pool, the held-KV store and the runner with its KV cache (and fast paths). Also what
    a re-partition builds for a model re-sharded in memory (engine/group/group.py), whose ranks
    agree on the block count under `blocks_key`, rank 0 waiting at most `limit_s`."""
    max_len = model.shape.max_positions
    if config.max_model_len is not None:
        if config.max_model_len > max_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_len}")
        max_len = config.max_model_len
    cc = config.cache
    per_token = ModelRunner.kv_bytes_per_token(model, backend.kv_dtype)  # fp8: 1 byte each
    max_len, num_blocks = kv_blocks(cc, device, per_token, max_len, sc.max_num_seqs, ranks,
                                    blocks_key, limit_s)
    host_blocks = cc.host_kv_tier_bytes // (per_token * cc.block_size)
    pool = BlockPool(num_blocks, cc.block_size, cc.enable_prefix_caching, host_blocks)
    windows = getattr(model.shape, "windows", None) or [None]
    if all(windows):  # every layer windowed: blocks all windows passed are freed early
        pool.window = max(windows)
    # held and exported KV has every KV head, whatever this rank keeps
    s = model.shape
    full_heads = getattr(s, "total_kv_heads", s.num_kv_heads)
    host = HeldKVStore(cc.held_kv_bytes, per_token * full_heads // s.num_kv_heads)
    tier = None
    if host_blocks:
        from batchgen_data.worker.kv_tier.tier import HostKVTier
        tier = HostKVTier(model, num_blocks, host_blocks, cc.block_size, max_len, backend)
    if ranks is not None:  # no fast path: the whole-step ones have no collectives
        runner: ModelRunner = tp_runner.TPRunner(model, num_blocks, cc.block_size, backend,
                                                 ranks, config.attention_micro_batch_seqs)
    else:
        runner = ModelRunner(model, num_blocks, cc.block_size, backend, store, tier,
                             config.attention_micro_batch_seqs)
    # the fast paths bake weight addresses in; none takes images or M-RoPE positions
    if store is None and ranks is None and not getattr(model, "takes_images", False):
        runner.build_fast_paths(sc.max_num_seqs, max_len, cuda_graphs=not config.enforce_eager,
                                max_num_batched_tokens=sc.max_num_batched_tokens)
    return max_len, pool, host, runner


def kv_blocks(cc: CacheConfig, device: torch.device, per_token: int, max_len: int,
              max_seqs: int, ranks: RankGroup | None = None,
              blocks_key: str = "num_kv_blocks", limit_s: float | None = None
              ) -> tuple[int, int]:
    """(the longest sequence, the KV cache's blocks): `num_kv_blocks` when set, else sized by
    `_num_blocks`; the ranks of a tensor-parallel engine agree on the fewest any holds. A cache
    that cannot hold one sequence of `max_len` is refused, or, when `num_kv_blocks` forces it
    (tests force a tiny cache on purpose), shortens the sequences."""
    num_blocks = cc.num_kv_blocks or _num_blocks(cc, device, per_token, max_len, max_seqs)
    if ranks is not None:  # every rank's cache has the same blocks: the fewest any can hold
        num_blocks = ranks.agree_min(blocks_key, num_blocks, limit_s)
    seq_blocks = -(-max_len // cc.block_size)
    if num_blocks < seq_blocks + 1:
        if cc.num_kv_blocks is None:
            raise ValueError(f"KV cache of {num_blocks} blocks cannot hold one sequence of "
                             f"max_model_len={max_len}; lower max_model_len")
        max_len = (num_blocks - 1) * cc.block_size
    return max_len, num_blocks


def offload_requested(config: EngineConfig) -> bool:
    return config.cpu_offload_gb > 0 or config.weight_memory_bytes is not None


def quantization_plan(path: Path, hf_config: Any, requested: str | None
                      ) -> QuantPlan | None:
    """The checkpoint's quantized modules, from its quantization_config and its tensors'
    headers (ValueError naming the field or tensor when something does not fit), or None."""
    from batchgen_data.models import quant_config, quant_formats

    cq = quant_config.parse(hf_config, requested)
    return None if cq is None else quant_formats.scan(path, cq)


def _head_dim(hf_config: Any) -> int:
    hf_config = getattr(hf_config, "text_config", None) or hf_config  # a vision-language one's
    latent = getattr(hf_config, "kv_lora_rank", None)
    if latent:  # MLA (DeepSeek-V3) caches one latent head: layers/mla.py
        return latent + hf_config.qk_rope_head_dim
    return (getattr(hf_config, "head_dim", None)
            or hf_config.hidden_size // hf_config.num_attention_heads)


def _num_blocks(cc: Any, device: torch.device, per_token: int, max_len: int, max_seqs: int) -> int:
    """Blocks for every sequence at full length (`max_seqs` x `max_len` tokens, plus one spare
    block), capped by the memory budget: `kv_cache_memory_bytes` when set, else the GPU's free
    memory down to `gpu_memory_utilization`, else `_CPU_KV_BYTES` of host RAM."""
    block_bytes = per_token * cc.block_size
    need = max_seqs * -(-max_len // cc.block_size) * block_bytes + block_bytes
    if cc.kv_cache_memory_bytes is not None:
        budget = cc.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - total * (1 - cc.gpu_memory_utilization))
    else:
        budget = _CPU_KV_BYTES
    return max(2, min(need, budget) // block_bytes)
