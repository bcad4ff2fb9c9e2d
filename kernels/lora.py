"""Multi-LoRA kernels: the low-rank product of a step whose tokens run under many adapters.

The step's tokens that have an adapter are listed in `token_idx`, grouped by adapter: segment
`s` is `token_idx[seg_starts[s]:seg_starts[s + 1]]`, all under the adapter in device slot
`seg_slots[s]`. Two segmented gather-matmuls (Punica's SGMV idea, written anew here) then add
each adapter's delta to the base layer's output without a loop over rows or adapters:

* `lora_shrink`: h[i] = x[token_idx[i]] @ a[slot(i)]^T   (x [T, K], a [L, R, K] → h [N, R]);
* `lora_expand`: y[token_idx[i]] += h[i] @ b[slot(i)]^T  (b [L, O, R], y [T, O], in place).

The layers (`layers/lora.py`) stack a fused layer's shards in `a`, so one shrink serves q|k|v,
and call the expand once per shard on column slices of h and y, with b a transposed view of
their B^T [L, R, O] (any strides: no block-diagonal B to store or multiply).

One program owns a block of one segment's rows and a tile of output columns, so each weight
tile it reads belongs to one adapter; rows of different segments never share a program, so the
expand's read-add-write of `y` needs no atomics (`token_idx` has each row once).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import (check_contiguous, check_device, check_last_dim_contiguous,
                      check_same_dtype, check_tensor)

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, tok_ptr, starts_ptr, slots_ptr,
                   k_dim, r_dim, stride_xm, stride_al, stride_ar, stride_hm,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    seg, pid_m, pid_r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(starts_ptr + seg)
    end = tl.load(starts_ptr + seg + 1)
    if pid_m * BLOCK_M >= end - start:
        return  # a block past this segment's rows
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    offs_m = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < end
    rows = tl.load(tok_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < r_dim
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]  # [M, K]
    a_ptrs = a_ptr + slot * stride_al + offs_r[None, :] * stride_ar + offs_k[:, None]  # [K, R]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = offs_k < k_dim - k0
        xv = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        av = tl.load(a_ptrs, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc = tl.dot(xv, av, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_r[None, :]
    tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, tok_ptr, starts_ptr, slots_ptr,
                   n_out, r_dim, stride_hm, stride_bl, stride_bn, stride_br, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    seg, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(starts_ptr + seg)
    end = tl.load(starts_ptr + seg + 1)
    if pid_m * BLOCK_M >= end - start:
        return
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    offs_m = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < end
    rows = tl.load(tok_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    offs_r = tl.arange(0, BLOCK_R)
    h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_r[None, :]  # [M, R]
    b_ptrs = (b_ptr + slot * stride_bl + offs_n[None, :] * stride_bn
              + offs_r[:, None] * stride_br)  # [R, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, r_dim, BLOCK_R):
        r_ok = offs_r < r_dim - r0
        hv = tl.load(h_ptrs, mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        bv = tl.load(b_ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(hv, bv, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_R
        b_ptrs += BLOCK_R * stride_br
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _segments(token_idx: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor,
              max_seg_len: int, kernel: object, data: torch.Tensor) -> None:
    check_tensor("token_idx", token_idx, 1, _INTS)
    check_tensor("seg_starts", seg_starts, 1, _INTS)
    check_tensor("seg_slots", seg_slots, 1, _INTS)
    if seg_starts.shape[0] != seg_slots.shape[0] + 1:
        raise ValueError(f"seg_starts has {seg_starts.shape[0]} entries for "
                         f"{seg_slots.shape[0]} segments (want one more)")
    if max_seg_len < 0:
        raise ValueError(f"max_seg_len={max_seg_len}: must be >= 0")
    check_device(kernel, ["x", "token_idx", "seg_starts", "seg_slots"],
                 [data, token_idx, seg_starts, seg_slots])


def _tile(n: int, low: int, high: int) -> int:
    t = low
    while t < n and t < high:
        t *= 2
    return t


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_idx: torch.Tensor,
                seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_seg_len: int
                ) -> torch.Tensor:
    """h [N, R] in x's dtype: row i is x[token_idx[i]] @ a[slot]^T for the segment of i.

    x [T, K] (stride 1 in the last dim); a [L, R, K] contiguous, x's dtype; token_idx [N],
    seg_starts [S + 1] (seg_starts[-1] == N), seg_slots [S] int32/int64, on x's device;
    `max_seg_len`: the longest segment (sizes the launch grid). fp32 accumulation."""
    check_tensor("x", x, 2, _FLOATS)
    check_tensor("a", a, 3, _FLOATS)
    check_same_dtype(["x", "a"], [x, a])
    if a.shape[2] != x.shape[1]:
        raise ValueError(f"a takes {a.shape[2]} inputs, x has {x.shape[1]} columns")
    check_last_dim_contiguous("x", x)
    check_contiguous("a", a)
    _segments(token_idx, seg_starts, seg_slots, max_seg_len, _shrink_kernel, x)
    n, r_dim, k_dim = token_idx.shape[0], a.shape[1], a.shape[2]
    h = torch.empty((n, r_dim), dtype=x.dtype, device=x.device)
    if n == 0 or seg_slots.shape[0] == 0:
        return h
    fp32 = x.dtype == torch.float32
    block_m = _tile(max_seg_len, 16, 64)
    block_r = _tile(r_dim, 16, 64)
    block_k = 32 if fp32 else 64
    grid = (seg_slots.shape[0], triton.cdiv(max_seg_len, block_m), triton.cdiv(r_dim, block_r))
    _shrink_kernel[grid](x, a, h, token_idx, seg_starts, seg_slots, k_dim, r_dim,
                         x.stride(0), a.stride(0), a.stride(1), h.stride(0),
                         BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
                         DOT_PRECISION="ieee" if fp32 else "tf32")
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, token_idx: torch.Tensor,
                seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_seg_len: int
                ) -> torch.Tensor:
    """In place: y[token_idx[i]] += h[i] @ b[slot]^T for the segment of i; returns y.

    y [T, O] and h [N, R] (stride 1 in the last dim: a fused layer's shard is a column slice
    of both); b [L, O, R] of any strides (B^T stored [L, R, O] is passed transposed); all one
    dtype; the segments as for `lora_shrink`. fp32 accumulation, one rounding into y."""
    check_tensor("y", y, 2, _FLOATS)
    check_tensor("h", h, 2, _FLOATS)
    check_tensor("b", b, 3, _FLOATS)
    check_same_dtype(["y", "h", "b"], [y, h, b])
    if b.shape[1] != y.shape[1] or b.shape[2] != h.shape[1]:
        raise ValueError(f"b {tuple(b.shape)} does not map h {tuple(h.shape)} onto y "
                         f"{tuple(y.shape)}")
    if h.shape[0] != token_idx.shape[0]:
        raise ValueError(f"h has {h.shape[0]} rows, token_idx {token_idx.shape[0]}")
    check_last_dim_contiguous("y", y)
    check_last_dim_contiguous("h", h)
    _segments(token_idx, seg_starts, seg_slots, max_seg_len, _expand_kernel, y)
    n, n_out, r_dim = h.shape[0], b.shape[1], b.shape[2]
    if n == 0 or seg_slots.shape[0] == 0:
        return y
    fp32 = y.dtype == torch.float32
    block_m = _tile(max_seg_len, 16, 64)
    block_n = 64 if fp32 else 128
    block_r = _tile(r_dim, 16, 32)
    grid = (seg_slots.shape[0], triton.cdiv(max_seg_len, block_m), triton.cdiv(n_out, block_n))
    _expand_kernel[grid](h, b, y, token_idx, seg_starts, seg_slots, n_out, r_dim,
                         h.stride(0), b.stride(0), b.stride(1), b.stride(2), y.stride(0),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
                         DOT_PRECISION="ieee" if fp32 else "tf32")
    return y
