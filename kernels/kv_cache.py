"""Scatter the new tokens' keys and values into the paged KV cache.

Cache layout (one layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, so slot
``s = block_id * block_size + offset`` starts at element ``s * num_kv_heads * head_dim`` and one
token's heads are one contiguous run. One program copies one token (all its heads), so the write
is a single coalesced store per token. ``slot_mapping[t] == -1`` skips token t (padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import (
    FLOAT_DTYPES,
    check_contiguous,
    check_device,
    check_last_dim_contiguous,
    check_same_dtype,
    check_shape,
    check_tensor,
    tile,
)


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, Hkv, D] (any token/head strides)
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D] contiguous
    v_cache_ptr,
    slot_ptr,  # [T] int64
    num_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)
    k = tl.load(k_ptr + tok * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + heads * stride_vh + dims, mask=mask)
    dst = slot * num_heads * head_dim + heads * head_dim + dims
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k[t], v[t]`` to slot ``slot_mapping[t]`` of ``k_cache, v_cache`` in place.

    k, v: ``[T, Hkv, D]``, stride 1 in the last dim (views into a fused qkv output are fine).
    k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` contiguous, same dtype as k.
    slot_mapping: int64 ``[T]``; -1 skips the token. Slots must be < num_blocks * block_size
    (not checked: that would need a device-to-host sync).
    """
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_tensor("v", v, 3, FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, 4, FLOAT_DTYPES)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    check_same_dtype(["k_cache", "v_cache", "k", "v"], [k_cache, v_cache, k, v])
    num_tokens, num_heads, head_dim = k.shape
    check_shape("v", v, k.shape)
    check_shape("v_cache", v_cache, k_cache.shape)
    if tuple(k_cache.shape[2:]) != (num_heads, head_dim):
        raise ValueError(
            f"k_cache heads/head_dim {tuple(k_cache.shape[2:])} do not match "
            f"k {(num_heads, head_dim)}"
        )
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    names = ["k", "v", "k_cache", "v_cache", "slot_mapping"]
    check_device(_write_kv_kernel, names, [k, v, k_cache, v_cache, slot_mapping])
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        BLOCK_H=tile(num_heads, 1), BLOCK_D=tile(head_dim, 1),
    )
