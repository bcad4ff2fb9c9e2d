"""Fused mixture-of-experts MLP: a grouped GEMM over experts, twice.

Each routed (token, slot) pair goes through its expert's SwiGLU MLP and comes back scaled by
its routing weight; a token's output is the sum over its ``k`` pairs. After
``moe_align_block_size`` has grouped the pairs by expert in blocks of ``BLOCK_M`` rows, one
kernel, ``_moe_gemm_kernel``, runs both GEMMs (the idea of vLLM's fused_moe kernel, written
anew here). Each program owns one block of pairs and one tile of output columns; every row of
the block uses the same expert's weights, so the expert loop of a naive MoE becomes a launch
grid and only experts that received a pair cost anything:

1. gate/up (``GATED``): rows are gathered from ``hidden`` (pair // k), multiplied by the gate
   and up rows of ``w13[e]`` in two accumulators, and ``silu(gate) * up`` is stored, so the
   ``[pairs, 2I]`` intermediate never reaches memory;
2. down (``ROUTED_WEIGHT``): the activations times ``w2[e]``, scaled by the pair's routing
   weight in the epilogue.
The ``k`` weighted contributions of each token are then summed (``[T, k, H] -> [T, H]``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import (
    check_contiguous,
    check_device,
    check_last_dim_contiguous,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from .moe_align import moe_align_block_size

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [T, K] when A_PER_TOKEN (row = pair // top_k), else [pairs, K]
    b_ptr,  # [E, N or 2N, K]
    c_ptr,  # [pairs, N]
    weights_ptr,  # [pairs] float32 routing weights
    sorted_ptr,  # [P] int32 pair indices grouped by expert (padding = num_pairs)
    expert_ids_ptr,  # [P / BLOCK_M] int32
    total_ptr,  # [1] int32 padded number of rows in use
    n_out, k_dim, num_pairs, top_k, num_m_blocks,
    stride_am, stride_be, stride_bn, stride_cm,
    A_PER_TOKEN: tl.constexpr, GATED: tl.constexpr, ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Programs walk GROUP_M row blocks per column tile, so neighbours share weight tiles in L2.
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(n_out, BLOCK_N)
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return  # a block past the padded total: no pair lives there

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + offs_m)  # [BLOCK_M]
    row_ok = pairs < num_pairs
    a_rows = (pairs // top_k) if A_PER_TOKEN else pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]  # [M, K]
    gate_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
    up_ptrs = gate_ptrs + n_out * stride_bn  # [K, N]: up rows follow the N gate rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = offs_k < k_dim - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & n_ok[None, :]
        acc = tl.dot(a, tl.load(gate_ptrs, mask=b_mask, other=0.0), acc,
                     input_precision=DOT_PRECISION)
        if GATED:
            acc_up = tl.dot(a, tl.load(up_ptrs, mask=b_mask, other=0.0), acc_up,
                            input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K

    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up, in float32
    if ROUTED_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def pick_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per GEMM block: small when experts get few pairs each (decode steps), where a big
    block would be mostly padding; large when they get many (prefill), for tensor-core reuse."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor,
            align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int, block_m: int,
            gated: bool) -> None:
    sorted_ids, expert_ids, total = align
    n_out, k_dim = c.shape[1], a.shape[1]
    fp32 = a.dtype == torch.float32
    # two B tiles in flight when gated: a narrower N tile keeps shared memory near 70 KB
    block_n = 64 if gated or fp32 else 128
    block_k = 32 if fp32 else 64
    num_m_blocks = triton.cdiv(sorted_ids.shape[0], block_m)
    grid = (num_m_blocks * triton.cdiv(n_out, block_n),)
    _moe_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, expert_ids, total,
        n_out, k_dim, c.shape[0], top_k, num_m_blocks,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        A_PER_TOKEN=gated, GATED=gated, ROUTED_WEIGHT=not gated,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=8 if block_m * block_n >= 64 * 128 else 4, num_stages=3,
    )


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  block_m: int | None = None) -> torch.Tensor:
    """MoE MLP output ``[T, H]`` in hidden's dtype:
    ``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x))``
    with ``x = hidden[t]`` and ``e = topk_ids[t, j]``.

    hidden ``[T, H]`` (stride 1 in the last dim); w13 ``[E, 2I, H]`` and w2 ``[E, H, I]``
    contiguous, hidden's dtype; topk_weights float32 ``[T, k]``; topk_ids int32/int64 ``[T, k]``.
    Accumulates in float32; the activations between the GEMMs are rounded to hidden's dtype.
    ``block_m``: rows per GEMM block (16, 32, 64, ...), chosen from the shapes when None.
    """
    check_tensor("hidden", hidden, 2, _FLOATS)
    check_tensor("w13", w13, 3, _FLOATS)
    check_tensor("w2", w2, 3, _FLOATS)
    check_tensor("topk_weights", topk_weights, 2, (torch.float32,))
    check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64))
    check_same_dtype(["hidden", "w13", "w2"], [hidden, w13, w2])
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    check_shape("w13", w13, (num_experts, 2 * inter, hidden_size))
    check_shape("w2", w2, (num_experts, hidden_size, inter))
    check_shape("topk_ids", topk_ids, topk_weights.shape)
    if topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows, hidden has {num_tokens}")
    check_last_dim_contiguous("hidden", hidden)
    check_contiguous("w13", w13)
    check_contiguous("w2", w2)
    names = ["hidden", "w13", "w2", "topk_weights", "topk_ids"]
    check_device(_moe_gemm_kernel, names, [hidden, w13, w2, topk_weights, topk_ids])
    if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0 or inter == 0:
        return torch.zeros((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    block_m = block_m or pick_block_m(num_pairs, num_experts)
    align = moe_align_block_size(topk_ids, block_m, num_experts)
    weights = topk_weights.contiguous().view(-1)  # [pairs]
    act = torch.empty((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    _launch(hidden, w13, act, weights, align, top_k, block_m, gated=True)
    # zeros: a pair routed outside [0, E) (an expert held elsewhere) is in no block and adds 0
    per_pair = torch.zeros((num_pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    _launch(act, w2, per_pair, weights, align, top_k, block_m, gated=False)
    return per_pair.view(num_tokens, top_k, hidden_size).sum(dim=1)
