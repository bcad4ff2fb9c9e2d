"""vLLM engine arguments: mapped, accepted as what the engine always does, or refused."""
from __future__ import annotations

import pytest

from batchgen_data.config import make_engine_config


def test_ray_quickstart_engine_kwargs_work() -> None:
    cfg = make_engine_config(None, enable_chunked_prefill=True, max_num_batched_tokens=4096,
                             max_model_len=16384)
    assert cfg.scheduler.max_num_batched_tokens == 4096 and cfg.max_model_len == 16384


def test_mapped_arguments() -> None:
    cfg = make_engine_config(None, swap_space=2, num_gpu_blocks_override=64)
    assert cfg.cache.held_kv_bytes == 2 << 30 and cfg.cache.num_kv_blocks == 64
    with pytest.raises(TypeError, match="same setting"):
        make_engine_config(None, swap_space=1, held_kv_bytes=5)


def test_no_ops_are_accepted() -> None:
    cfg = make_engine_config(None, tensor_parallel_size=1, disable_log_stats=True,
                             tokenizer_mode="auto", kv_cache_dtype="auto", quantization=None,
                             enforce_eager=True, gpu_memory_utilization=0.5)
    assert cfg.enforce_eager and cfg.cache.gpu_memory_utilization == 0.5


@pytest.mark.parametrize("kw, words", [
    ({"pipeline_parallel_size": 4}, "only by tensor_parallel_size"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size=0"),
    ({"tensor_parallel_size": 2, "cpu_offload_gb": 1}, "cpu_offload_gb=1: not supported"),
    ({"enable_chunked_prefill": False}, "always computes prompts in chunks"),
    ({"quantization": "bitsandbytes"}, "quantized"),
    ({"calculate_kv_scales": True}, "never computed from the first batch"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "only e4m3"),
    ({"revision": "main"}, "nothing is downloaded"),
])
def test_refused_values_say_why(kw: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        make_engine_config(None, **kw)


def test_tensor_and_expert_parallel_are_engine_arguments() -> None:
    cfg = make_engine_config(None, tensor_parallel_size=2, enable_expert_parallel=True)
    assert cfg.tensor_parallel_size == 2 and cfg.enable_expert_parallel


def test_unknown_names_still_raise_type_error() -> None:
    with pytest.raises(TypeError, match="unknown engine argument.*tensor_parallel_size"):
        make_engine_config(None, tensor_paralel_size=1)


def test_lora_arguments_are_taken() -> None:
    cfg = make_engine_config(None, enable_lora=True, max_loras=4, max_lora_rank=32)
    assert cfg.lora.enable_lora and cfg.lora.max_loras == 4 and cfg.lora.max_lora_rank == 32
    with pytest.raises(ValueError, match="max_lora_rank=0"):
        make_engine_config(None, enable_lora=True, max_lora_rank=0)
    # LoRA at TP > 1 splits each adapter as its layer (tests/integration/test_tp_lora.py)
    cfg = make_engine_config(None, enable_lora=True, tensor_parallel_size=2)
    assert cfg.lora.enable_lora and cfg.tensor_parallel_size == 2
