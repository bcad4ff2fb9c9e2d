"""SiLU-and-multiply, the activation of gated (SwiGLU) MLPs as in Llama and Qwen.

The fused gate/up projection produces ``[T, 2*I]``; doing ``silu(gate) * up`` in one pass reads
that once and writes ``[T, I]`` once instead of materialising ``silu(gate)`` in between.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_device, check_last_dim_contiguous, check_tensor

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2*I]
    out_ptr,  # [T, I]
    inter,  # I
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Return ``silu(x[:, :I]) * x[:, I:]`` as a new ``[T, I]`` tensor of x's dtype.

    x: ``[T, 2*I]``, float16/bfloat16/float32, stride 1 in the last dim (row stride is free).
    Computed in float32.
    """
    x = check_tensor("x", x, 2, FLOAT_DTYPES)
    if x.shape[1] % 2 != 0:
        raise ValueError(f"x last dim must be even (gate and up halves), got {x.shape[1]}")
    check_last_dim_contiguous("x", x)
    check_device(_silu_and_mul_kernel, ["x"], [x])
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)  # [T, I]
    if num_tokens == 0 or inter == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(inter))
    grid = (num_tokens, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x, out, inter, x.stride(0), out.stride(0), BLOCK=block)
    return out
