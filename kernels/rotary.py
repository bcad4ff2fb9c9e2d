"""Rotary position embedding (NeoX / Llama "rotate_half" style), applied to q and k in place.

``cos_sin_cache[pos]`` holds ``R/2`` cosines followed by ``R/2`` sines, where ``R`` (the rotary
dim) is ``cos_sin_cache.shape[1] <= head_dim``; dims past ``R`` are left untouched (partial
rotary). Pair ``(i, i + R/2)`` rotates by angle ``i``:
``x1' = x1*cos - x2*sin``, ``x2' = x2*cos + x1*sin``.
One program handles one token, all heads of q and then of k, so the cos/sin row is loaded once.
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
def _rotate_heads(x_ptr, stride_h, num_heads, cos, sin, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_R)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    p1 = x_ptr + heads * stride_h + dims
    p2 = p1 + HALF
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, Hkv, D]
    pos_ptr,  # [T] int64
    cache_ptr,  # [max_pos, R] contiguous
    num_q_heads,
    num_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    HALF: tl.constexpr,  # R / 2
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok)
    r = tl.arange(0, BLOCK_R)[None, :]
    cos = tl.load(cache_ptr + pos * (2 * HALF) + r, mask=r < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * (2 * HALF) + HALF + r, mask=r < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + tok * stride_qt, stride_qh, num_q_heads, cos, sin,
                  HALF, BLOCK_HQ, BLOCK_R)
    _rotate_heads(k_ptr + tok * stride_kt, stride_kh, num_k_heads, cos, sin,
                  HALF, BLOCK_HK, BLOCK_R)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place by ``positions``; returns ``(q, k)`` (the same tensor objects).

    q: ``[T, H, D]``, k: ``[T, Hkv, D]``, same float dtype, stride 1 in the last dim (views into a
    fused qkv output are fine). positions: int64 ``[T]``, each in ``[0, max_pos)`` (not checked: it
    would need a device sync). cos_sin_cache: ``[max_pos, R]`` contiguous, any float dtype, with
    R even and ``R <= D``.
    """
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_same_dtype(["q", "k"], [q, k])
    check_tensor("positions", positions, 1, (torch.int64,))
    check_tensor("cos_sin_cache", cos_sin_cache, 2, FLOAT_DTYPES)
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    check_shape("positions", positions, (num_tokens,))
    rot = cos_sin_cache.shape[1]
    if rot % 2 != 0 or not 0 < rot <= head_dim:
        raise ValueError(f"cos_sin_cache dim 1 must be even and in (0, {head_dim}], got {rot}")
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("k", k)
    check_contiguous("cos_sin_cache", cos_sin_cache)
    names = ["q", "k", "positions", "cos_sin_cache"]
    check_device(_rotary_kernel, names, [q, k, positions, cos_sin_cache])
    if num_tokens == 0:
        return q, k
    num_k_heads = k.shape[1]
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache, num_q_heads, num_k_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        HALF=rot // 2, BLOCK_HQ=tile(num_q_heads, 1), BLOCK_HK=tile(num_k_heads, 1),
        BLOCK_R=tile(rot // 2, 1),
    )
    return q, k
