"""Quantized matmuls for the GPU (Triton): weight-only W4A16 / W8A16 / FP8-weight, and FP8 W8A8
with block-scaled weights and dynamic per-token-group activation scales (DeepSeek-V3 / Qwen3 FP8).

`quant_linear` takes the stored form of `batchgen_data/layers/quant.py` (codes int8 [N, K], int4
two per byte [N, ceil(K / 2)] or fp8 bit patterns [N, K]; fp32 scales [N, G] per `group` input
columns; optional fp32 zeros) and widens each tile of codes inside the K loop: the weight is read
in its stored bytes. `per_token_group_quant_fp8` quantizes activations to e4m3 with one scale per
token and `group` columns (amax / 448), and `fp8_block_matmul` multiplies them with an e4m3
weight whose scales cover [block_n, block_k] blocks: each K step is one fp8 `tl.dot` scaled by the
two scales. References: `kernels/reference.py` (`quant_linear`, `per_token_group_quant_fp8`,
`fp8_block_matmul`). Tested under ``TRITON_INTERPRET=1`` in fp32/fp16; the fp8 `tl.dot` needs
sm_89+ on a device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_contiguous, check_device, check_tensor

_KINDS = {"int8": 0, "int4": 1, "fp8": 2}
FP8_MAX = 448.0


@triton.jit
def _weight_only_kernel(
    x_ptr,  # [M, K] activations
    c_ptr,  # codes: int8 [N, K], uint8 [N, ceil(K/2)] (int4), float8e4nv [N, K]
    s_ptr,  # [N, G] fp32 scales
    z_ptr,  # [N, G] fp32 zeros (HAS_ZERO)
    y_ptr,  # [M, N]
    M, N, K, G, group, zdef,
    stride_cn,
    KIND: tl.constexpr, HAS_ZERO: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wmask = n_ok[:, None] & k_ok[None, :]
        rows = offs_n[:, None].to(tl.int64) * stride_cn
        if KIND == 1:  # two codes a byte, the even column in the low nibble
            b = tl.load(c_ptr + rows + (offs_k // 2)[None, :], mask=wmask, other=0).to(tl.int32)
            w = ((b >> ((offs_k % 2) * 4)[None, :]) & 15).to(tl.float32)
        elif KIND == 2:  # e4m3 bits widened as csrc/quant_gemm.c does (exact, subnormals too)
            b = tl.load(c_ptr + rows + offs_k[None, :], mask=wmask, other=0).to(tl.int32)
            bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
            w = bits.to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120
        else:
            w = tl.load(c_ptr + rows + offs_k[None, :], mask=wmask, other=0).to(tl.float32)
        gidx = offs_n[:, None].to(tl.int64) * G + (offs_k // group)[None, :]
        s = tl.load(s_ptr + gidx, mask=wmask, other=0.0)
        if HAS_ZERO:
            w = (w - tl.load(z_ptr + gidx, mask=wmask, other=0.0)) * s
        else:
            w = (w - zdef) * s  # [BLOCK_N, BLOCK_K]
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w).to(x.dtype))
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def quant_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, kind: str, group: int) -> torch.Tensor:
    """x [..., K] (fp32/fp16/bf16) times the dequantized weight [N, K]^T -> [..., N] in x's
    dtype, accumulated in fp32 (as `reference.quant_linear`)."""
    if kind not in _KINDS or group < 1:
        raise ValueError(f"quant_linear: kind={kind!r} (one of {tuple(_KINDS)}), group={group}")
    check_tensor("x", x, x.dim(), FLOAT_DTYPES)
    k = x.shape[-1]
    n = codes.shape[0]
    cols = -(-k // 2) if kind == "int4" else k
    g = -(-k // group)
    if codes.dim() != 2 or codes.shape[1] != cols or codes.element_size() != 1:
        raise ValueError(f"quant_linear: codes {tuple(codes.shape)} {codes.dtype}, want "
                         f"[{n}, {cols}] one byte each ({kind}, K={k})")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is not None:
            check_tensor(name, t, 2, (torch.float32,))
            if tuple(t.shape) != (n, g):
                raise ValueError(f"quant_linear: {name} {tuple(t.shape)}, want [{n}, {g}]")
            check_contiguous(name, t)
    check_contiguous("codes", codes)
    named = {"x": x, "codes": codes, "scales": scales, **({} if zeros is None else {"zeros": zeros})}
    check_device(_weight_only_kernel, tuple(named), tuple(named.values()))
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    view = torch.int8 if kind == "int8" else torch.uint8
    zdef = 8.0 if kind == "int4" else 0.0
    block_m, block_n, block_k = 16, 32, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _weight_only_kernel[grid](
        x2, codes.view(view), scales, zeros if zeros is not None else scales, y,
        m, n, k, g, group, zdef, codes.stride(0),
        KIND=_KINDS[kind], HAS_ZERO=zeros is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y.view(*x.shape[:-1], n)


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, K, G, group, BLOCK: tl.constexpr):
    row, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = g * group + tl.arange(0, BLOCK)
    ok = (tl.arange(0, BLOCK) < group) & (offs < K)
    x = tl.load(x_ptr + row * K + offs, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10) / 448.0
    tl.store(q_ptr + row * K + offs, (x / scale).to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * G + g, scale)


def per_token_group_quant_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q float8_e4m3fn [M, K], scales fp32 [M, ceil(K / group)]): one scale per token and
    `group` columns, amax / 448 (as DeepSeek-V3's dynamic activation scheme)."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_contiguous("x", x)
    m, k = x.shape
    g = -(-k // group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, g, dtype=torch.float32, device=x.device)
    if m:
        _group_quant_kernel[(m, g)](x, q, s, k, g, group, BLOCK=triton.next_power_of_2(group))
    return q, s


@triton.jit
def _fp8_block_kernel(
    xq_ptr, xs_ptr,  # [M, K] e4m3, [M, G] fp32 (G = ceil(K / BLOCK_K))
    w_ptr, ws_ptr,  # [N, K] e4m3, [ceil(N / block_n), G] fp32
    y_ptr, M, N, K, G, block_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, G):  # one K step per scale block (BLOCK_K == the block's columns)
        offs_k = g * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        # e4m3 passed as bytes: a masked-out byte 0 is +0.0
        a = tl.load(xq_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        b = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        sa = tl.load(xs_ptr + offs_m.to(tl.int64) * G + g, mask=m_ok, other=0.0)
        sb = tl.load(ws_ptr + (offs_n // block_n).to(tl.int64) * G + g, mask=n_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_block_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     block: tuple[int, int]) -> torch.Tensor:
    """FP8 W8A8: x [M, K] quantized per token and `block[1]` columns, times the e4m3 `weight`
    [N, K] with `weight_scale` [ceil(N / block[0]), ceil(K / block[1])] -> [M, N] in x's dtype."""
    xq, xs = per_token_group_quant_fp8(x.contiguous(), block[1])
    return fp8_block_matmul_quantized(xq, xs, weight, weight_scale, block, x.dtype)


def fp8_block_matmul_quantized(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor,
                               weight_scale: torch.Tensor, block: tuple[int, int],
                               out_dtype: torch.dtype) -> torch.Tensor:
    """`fp8_block_matmul` on activations already quantized (`per_token_group_quant_fp8`)."""
    x = xq
    check_tensor("x", x, 2, (torch.float8_e4m3fn,))
    check_tensor("weight", weight, 2, (torch.float8_e4m3fn,))
    check_tensor("weight_scale", weight_scale, 2, (torch.float32,))
    m, k = x.shape
    n = weight.shape[0]
    bn, bk = block
    if weight.shape[1] != k or tuple(weight_scale.shape) != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"fp8_block_matmul: weight {tuple(weight.shape)}, weight_scale "
                         f"{tuple(weight_scale.shape)} do not fit x {tuple(x.shape)} in blocks "
                         f"{block}")
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"fp8_block_matmul: block columns {bk} must be a power of two >= 16")
    for name, t in (("x", x), ("weight", weight), ("weight_scale", weight_scale)):
        check_contiguous(name, t)
    check_device(_fp8_block_kernel, ("x", "weight", "weight_scale"), (x, weight, weight_scale))
    if tuple(xs.shape) != (m, -(-k // bk)) or xs.dtype != torch.float32:
        raise ValueError(f"fp8_block_matmul: activation scales {tuple(xs.shape)} {xs.dtype}, "
                         f"want [{m}, {-(-k // bk)}] float32")
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    block_m, block_n = 16, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_kernel[grid](xq.view(torch.uint8), xs.contiguous(), weight.view(torch.uint8),
                            weight_scale, y, m, n, k, xs.shape[1], bn,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk)
    return y
