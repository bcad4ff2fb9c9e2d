"""Scatter the new tokens' keys and values into the paged KV cache.

Cache layout (one layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, so slot
``s = block_id * block_size + offset`` starts at element ``s * num_kv_heads * head_dim`` and one
token's heads are one contiguous run. One program copies one token (all its heads), so the write
is a single coalesced store per token. ``slot_mapping[t] == -1`` skips token t (padding).

An FP8 cache (float8_e4m3fn, `batchgen_data/layers/kv_quant.py`) takes ``x * inv_scale`` clamped
to +-448 and rounded to the nearest e4m3 value, ties to even, by integer arithmetic on the fp32
bits (`_e4m3_bits`): bit for bit torch's cast, on any GPU and under the interpreter (no fp8
type is used, so no sm_89 is needed and the interpreter's fp8 rounding is never asked).
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
def _e4m3_bits(x):
    """fp32 -> float8_e4m3fn bit patterns (int32 0..255): clamp to +-448, round to nearest
    even. Normals: drop 20 mantissa bits with a round-half-even carry and rebias the exponent
    (127 -> 7); below 2^-6 the code is the subnormal count of 2^-9, rounded by the fp32 add of
    2^23 (exact: the product by 512 is)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960  # 960 = (127 - 7) << 3
    sub = ((a.to(tl.float32, bitcast=True) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return tl.where(a < (121 << 23), sub, normal) | sign


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
    inv_k_scale,  # FP8: 1 / k_scale in fp32
    inv_v_scale,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,  # the caches are e4m3 bytes (uint8 views)
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
    if FP8:
        k = _e4m3_bits(k.to(tl.float32) * inv_k_scale).to(tl.uint8)
        v = _e4m3_bits(v.to(tl.float32) * inv_v_scale).to(tl.uint8)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``k[t], v[t]`` to slot ``slot_mapping[t]`` of ``k_cache, v_cache`` in place.

    k, v: ``[T, Hkv, D]``, stride 1 in the last dim (views into a fused qkv output are fine).
    k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` contiguous, same dtype as k, or both
    float8_e4m3fn: then the codes of ``k / k_scale``, ``v / v_scale`` are stored (the scales
    are ignored otherwise).
    slot_mapping: int64 ``[T]``; -1 skips the token. Slots must be < num_blocks * block_size
    (not checked: that would need a device-to-host sync).
    """
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_tensor("v", v, 3, FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES + (torch.float8_e4m3fn,))
    check_tensor("v_cache", v_cache, 4, FLOAT_DTYPES + (torch.float8_e4m3fn,))
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    check_same_dtype(["k_cache", "v_cache"], [k_cache, v_cache])
    check_same_dtype(["k", "v"] if fp8 else ["k_cache", "k", "v"],
                     [k, v] if fp8 else [k_cache, k, v])
    inv_k, inv_v = (check_kv_scales(k_scale, v_scale) if fp8 else (1.0, 1.0))
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
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), inv_k, inv_v,
        BLOCK_H=tile(num_heads, 1), BLOCK_D=tile(head_dim, 1), FP8=fp8,
    )


def check_kv_scales(k_scale: float, v_scale: float) -> tuple[float, float]:
    """(1 / k_scale, 1 / v_scale) rounded to fp32; ValueError unless both are positive."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, (int, float)) or not 0 < s < float("inf"):
            raise ValueError(f"{name} must be a positive finite float, got {s!r}")
    return (float(torch.tensor(1.0 / k_scale, dtype=torch.float32)),
            float(torch.tensor(1.0 / v_scale, dtype=torch.float32)))
