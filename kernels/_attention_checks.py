"""Argument checks and launch heuristics shared by the two paged-attention launchers.

Kept apart from ``attention.py`` so that file holds only the kernels and their launchers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _checks
from ._checks import check_contiguous, check_same_dtype, check_shape, check_tensor, tile

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_MAX_SPLITS = 16
# Below this many tokens per split, merging partial results costs more than the parallelism buys.
_MIN_TOKENS_PER_SPLIT = 256
# One prefill program's tiles, in bytes of q's dtype: its q tile, and its K and V tiles
# together. For bf16 that is 48 KB of shared memory (MLA's 1024-wide head tile: 96 KB, rows
# and tokens held at 16, tl.dot's least), well under the H200's 228 KB per SM. Compiled for
# sm_90, larger K/V tiles, or q tiles of more than half the rows in distinct positions, spilled
# registers (a tile is loaded through one 64-bit address per element).
PREFILL_Q_TILE_BYTES = 32768
PREFILL_KV_TILE_BYTES = 16384


_NO_WINDOW = 1 << 30  # the kernels' window when none is given: longer than any sequence


def window_and_sinks(sliding_window: int | None, sinks: torch.Tensor | None, q: torch.Tensor
                      ) -> tuple[int, torch.Tensor | None]:
    """(the window the kernels take, the sinks as float32 [H] on q's device, or None)."""
    if sliding_window is not None and (not isinstance(sliding_window, int)
                                       or sliding_window < 0):
        raise ValueError(f"sliding_window must be None or an int >= 0, got {sliding_window!r}")
    if sinks is not None:
        if sinks.shape != (q.shape[1],):
            raise ValueError(f"sinks must be [num_heads={q.shape[1]}], got {tuple(sinks.shape)}")
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    return sliding_window or _NO_WINDOW, sinks


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


@dataclass(frozen=True)
class PrefillTiles:
    """How `paged_prefill_attention` cuts its work: a program owns ``positions`` new tokens x
    ``heads`` query heads of one kv head (the rows of its q tile, heads fastest), so each K/V
    tile it loads serves all those heads."""

    heads: int  # the whole GQA group, or a block of it when the group alone overflows a tile
    rows: int  # power of two >= positions * heads (the rows past that product are masked)
    block_n: int  # KV tokens per tile
    num_warps: int

    @property
    def positions(self) -> int:
        return self.rows // self.heads


def prefill_tiles(head_dim: int, group: int, max_seqlen_q: int, elem_size: int
                  ) -> PrefillTiles:
    """Tiles for a prefill of ``group`` query heads per kv head, q elements of ``elem_size``
    bytes."""
    block_d = tile(head_dim)
    cap = max(16, min(128, PREFILL_Q_TILE_BYTES // (block_d * elem_size)))
    heads = min(group, cap)
    # positions fill at most half the rows (the causal diagonal's masked work grows with them,
    # a group's heads add none), and a short chunk gets a short tile
    rows = min(cap, tile(min(max_seqlen_q, cap // 2) * heads))
    block_n = max(16, min(64, PREFILL_KV_TILE_BYTES // (2 * block_d * elem_size)))
    # the [rows, block_d] fp32 accumulator sits in registers: 32 a thread at 4096 over 4 warps
    num_warps = 8 if rows * block_d >= 4096 else 4
    return PrefillTiles(heads, rows, block_n, num_warps)
