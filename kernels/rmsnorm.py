"""RMSNorm and the fused residual-add + RMSNorm used between transformer sub-layers.

``rms_norm`` returns a new tensor. ``fused_add_rms_norm`` works **in place** (the vLLM convention):
``residual += x`` and then ``x = rms_norm(residual)``, so a decoder layer keeps reusing the same
two buffers and the residual stream is read and written once per layer instead of three times.
Both compute the mean square and the scaling in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import (
    FLOAT_DTYPES,
    check_contiguous,
    check_device,
    check_same_dtype,
    check_shape,
    check_tensor,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [R, N] input; with ADD_RESIDUAL also receives the normed output
    res_ptr,  # [R, N] residual (only with ADD_RESIDUAL)
    w_ptr,  # [N]
    out_ptr,  # [R, N]
    n_cols,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        x += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_ptr + offs, x.to(res_ptr.dtype.element_ty), mask=mask)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x must be a torch.Tensor with at least one dim")
    check_tensor("x", x, x.dim(), FLOAT_DTYPES)
    check_contiguous("x", x)
    check_tensor("weight", weight, 1, FLOAT_DTYPES)
    check_shape("weight", weight, (x.shape[-1],))
    check_contiguous("weight", weight)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            out: torch.Tensor, eps: float) -> None:
    n_cols = x.shape[-1]
    rows = x.numel() // n_cols if n_cols else 0
    if rows == 0:
        return
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, n_cols, float(eps),
        ADD_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Return ``x / sqrt(mean(x**2, -1) + eps) * weight`` as a new tensor of x's dtype.

    x: ``[..., N]`` contiguous, weight: ``[N]`` (any float dtype).
    """
    _check(x, weight, eps)
    check_device(_rms_norm_kernel, ["x", "weight"], [x, weight])
    out = torch.empty_like(x)
    _launch(x, None, weight, out, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += x``, then ``x = rms_norm(residual, weight, eps)``.

    Returns ``(x, residual)``, the same tensor objects that were passed in, now updated.
    x, residual: ``[..., N]`` contiguous, same shape and dtype; weight: ``[N]``.
    """
    _check(x, weight, eps)
    check_tensor("residual", residual, x.dim(), FLOAT_DTYPES)
    check_shape("residual", residual, x.shape)
    check_same_dtype(["x", "residual"], [x, residual])
    check_contiguous("residual", residual)
    check_device(_rms_norm_kernel, ["x", "residual", "weight"], [x, residual, weight])
    _launch(x, residual, weight, x, eps)
    return x, residual
