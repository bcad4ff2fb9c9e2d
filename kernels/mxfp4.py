"""MXFP4 weight-only matmul for the GPU (Triton): y = x @ W^T (+ bias) with W read as stored.

The weight is the OCP Microscaling FP4 form gpt-oss's experts ship in (`layers/mxfp4.py`):
uint8 `blocks` [N, K / 2], two E2M1 codes a byte with the even column in the low nibble, and
uint8 `scales` [N, K / 32], one E8M0 exponent per 32 values (2^(s - 127)). Each K tile of codes
is decoded inside the loop (sign, two exponent bits with bias 1, one mantissa bit) and scaled by
its block's power of two built from the exponent's bits, so the weight crosses memory at half a
byte a value. Reference: `kernels/reference.py: mxfp4_linear`; tested under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_contiguous, check_device, check_tensor

BLOCK = 32  # values per E8M0 scale


@triton.jit
def _mxfp4_kernel(
    x_ptr,  # [M, K] activations
    b_ptr,  # [N, K / 2] uint8: two E2M1 codes a byte
    s_ptr,  # [N, K / 32] uint8: E8M0 exponents
    bias_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N]
    M, N, K,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    half_k = K // 2
    groups = K // 32
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wmask = n_ok[:, None] & k_ok[None, :]
        byte = tl.load(b_ptr + offs_n[:, None].to(tl.int64) * half_k + (offs_k // 2)[None, :],
                       mask=wmask, other=0).to(tl.int32)
        code = (byte >> ((offs_k % 2) * 4)[None, :]) & 15
        exp = (code >> 1) & 3
        mant = (code & 1).to(tl.float32)
        # E2M1: exponent 0 is subnormal (m / 2), else (1 + m / 2) * 2^(e - 1)
        pow2 = tl.where(exp == 3, 4.0, tl.where(exp == 2, 2.0, 1.0))
        mag = tl.where(exp == 0, mant * 0.5, (1.0 + mant * 0.5) * pow2)
        w = tl.where((code & 8) != 0, -mag, mag)
        e8 = tl.load(s_ptr + offs_n[:, None].to(tl.int64) * groups + (offs_k // 32)[None, :],
                     mask=wmask, other=127).to(tl.int32)
        # 2^(e - 127) from its bits: a normal float for e >= 1, 2^-127 the one subnormal
        bits = tl.where(e8 == 0, 0x00400000, e8 << 23)
        scale = bits.to(tl.float32, bitcast=True)
        scale = tl.where(e8 == 255, float("nan"), scale)
        w = w * scale  # [BLOCK_N, BLOCK_K]
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w).to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (fp32/fp16/bf16) times the MXFP4 weight [N, K]^T (+ bias [N]) -> [..., N] in
    x's dtype, accumulated in fp32 (as `reference.mxfp4_linear`). K must be a multiple of 32."""
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"mxfp4_linear: K={k} is not a multiple of {BLOCK}")
    n = blocks.shape[0] if blocks.dim() == 2 else -1
    if (blocks.dim() != 2 or blocks.dtype != torch.uint8 or blocks.shape[1] != k // 2):
        raise ValueError(f"mxfp4_linear: blocks {tuple(blocks.shape)} {blocks.dtype}, want "
                         f"uint8 [N, {k // 2}]")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (n, k // BLOCK):
        raise ValueError(f"mxfp4_linear: scales {tuple(scales.shape)} {scales.dtype}, want "
                         f"uint8 [{n}, {k // BLOCK}]")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"mxfp4_linear: bias {tuple(bias.shape)}, want [{n}]")
    check_tensor("x", x, x.dim(), FLOAT_DTYPES)
    check_contiguous("blocks", blocks)
    check_contiguous("scales", scales)
    named = {"x": x, "blocks": blocks, "scales": scales,
             **({} if bias is None else {"bias": bias})}
    check_device(_mxfp4_kernel, tuple(named), tuple(named.values()))
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    block_m, block_n, block_k = 16, 32, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _mxfp4_kernel[grid](
        x2, blocks, scales, bias if bias is not None else scales, y, m, n, k,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y.view(*x.shape[:-1], n)
