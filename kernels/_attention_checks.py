"""Argument checks and launch heuristics shared by the two paged-attention launchers.

Kept apart from ``attention.py`` so that file holds only the kernels and their launchers.
"""

from __future__ import annotations

import torch

from . import _checks
from ._checks import check_contiguous, check_same_dtype, check_shape, check_tensor

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_MAX_SPLITS = 16
# Below this many tokens per split, merging partial results costs more than the parallelism buys.
_MIN_TOKENS_PER_SPLIT = 256


def check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
    scale: float,
) -> int:
    """Validate the paged cache, block tables and lengths against q (debug mode only,
    ``_checks.ENABLED``); return the GQA group size."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    if not _checks.ENABLED:
        return num_heads // k_cache.shape[2]
    check_tensor("k_cache", k_cache, 4, _FLOATS + (torch.float8_e4m3fn,))
    check_tensor("v_cache", v_cache, 4, _FLOATS + (torch.float8_e4m3fn,))
    if k_cache.dtype == torch.float8_e4m3fn:  # an FP8 cache: codes and scales, any q dtype
        check_same_dtype(["k_cache", "v_cache"], [k_cache, v_cache])
    else:
        check_same_dtype(["q", "k_cache", "v_cache"], [q, k_cache, v_cache])
    check_shape("v_cache", v_cache, k_cache.shape)
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if k_cache.shape[1] <= 0:
        raise ValueError(f"k_cache block_size must be > 0, got {k_cache.shape[1]}")
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    if block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows, expected num_seqs={num_seqs}"
        )
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(
            f"block_tables rows must be contiguous, got strides {block_tables.stride()}"
        )
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    check_shape("seq_lens", seq_lens, (num_seqs,))
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    return num_heads // num_kv_heads


def pick_num_splits(
    requested: int | None, num_programs: int, max_tokens: int, device: torch.device
) -> int:
    """Split-K factor for decode: enough programs to fill the GPU, never a trivially short split.

    ``max_tokens`` is the static bound ``max_blocks_per_seq * block_size``, so choosing needs no
    device-to-host sync. On the CPU interpreter extra programs only cost time, so default to 1.
    """
    if requested is not None:
        if not isinstance(requested, int) or requested < 1:
            raise ValueError(f"num_splits must be a positive int, got {requested!r}")
        return requested
    if device.type != "cuda" or num_programs == 0:
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    splits = 1
    while (
        splits < _MAX_SPLITS
        and num_programs * splits < target
        and max_tokens >= 2 * splits * _MIN_TOKENS_PER_SPLIT
    ):
        splits *= 2
    return splits
