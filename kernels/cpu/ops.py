"""Residual add + RMSNorm, the rotary embedding and SwiGLU's activation in C, for fp32 on the
CPU.

A decode step runs these on a few rows, where torch's per-op dispatch and allocation cost more
than the arithmetic, and every layer of every step pays it: so each is one C call, in
`csrc/norm_rope.c`, built by `build.library()`. The rotation is bitwise equal to the torch path;
the RMSNorm sums its mean of squares in another order, and SiLU's exp is a vector polynomial,
so they agree to float rounding. SiLU * up is one pass instead of torch's three (chunk, silu,
mul), each of which reads and writes the whole activation of a prefill step. A first-use
self-check compares all three with torch.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from batchgen_data.kernels.cpu import build as cpu_kernels

log = logging.getLogger(__name__)


def available() -> bool:
    """Whether `add_rms_norm`, `rotate_` and `silu_mul` run here: the kernels built and agree
    with torch on a first-use self-check. Callers run them on fp32 CPU tensors only."""
    return _checked()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without `residual`: rms_norm(x). With it: (rms_norm(x + residual), x + residual).
    x [..., n] fp32; rows are the leading dims flattened."""
    lib = cpu_kernels.library()
    assert lib is not None
    n = x.shape[-1]
    if not x.is_contiguous():
        x = x.contiguous()
    if weight.shape != (n,) or not weight.is_contiguous():
        raise ValueError(f"add_rms_norm: weight {tuple(weight.shape)} for rows of {n}")
    rows = x.numel() // n if n else 0
    out = torch.empty_like(x)
    res_out = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} vs x {tuple(x.shape)}")
        residual = residual.contiguous()
        res_out = torch.empty_like(x)
    lib.bg_add_rms_norm_f32(x.data_ptr(), None if residual is None else residual.data_ptr(),
                            weight.data_ptr(), float(eps), out.data_ptr(),
                            None if res_out is None else res_out.data_ptr(), rows, n,
                            torch.get_num_threads())
    return out if res_out is None else (out, res_out)


def rotate_(x2d: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor,
            cos_sin: torch.Tensor) -> None:
    """Rotates, in place, the first `heads` heads of every row of `x2d` [T, >= heads * head_dim]
    (a row-contiguous fp32 tensor, e.g. the fused qkv output) by the rows of `cos_sin`
    [max_positions, head_dim] ([cos | sin]) at `positions` [T]."""
    lib = cpu_kernels.library()
    assert lib is not None
    if x2d.dim() != 2 or x2d.stride(1) != 1 or x2d.shape[1] < heads * head_dim or head_dim % 2:
        raise ValueError(f"rotate_: x {tuple(x2d.shape)} strides {x2d.stride()}, "
                         f"{heads} heads of {head_dim}")
    if not cos_sin.is_contiguous() or cos_sin.dtype != torch.float32 or cos_sin.shape[1] != head_dim:
        raise ValueError(f"rotate_: cos/sin cache {tuple(cos_sin.shape)} {cos_sin.dtype}")
    pos = _checked_positions(positions, cos_sin.shape[0])
    if pos.numel() != x2d.shape[0]:
        raise ValueError(f"rotate_: {pos.numel()} positions for {x2d.shape[0]} rows")
    lib.bg_rotate_f32(x2d.data_ptr(), x2d.shape[0], heads, head_dim, x2d.stride(0),
                      cos_sin.data_ptr(), pos.data_ptr())


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation for the fused gate|up output: silu(gu[..., :I]) * gu[..., I:]."""
    lib = cpu_kernels.library()
    assert lib is not None
    if not gu.is_contiguous():
        gu = gu.contiguous()
    two_i = gu.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_mul: last dim {two_i} is not gate|up")
    out = gu.new_empty(*gu.shape[:-1], two_i // 2)
    rows = gu.numel() // two_i if two_i else 0
    lib.bg_silu_mul_f32(gu.data_ptr(), out.data_ptr(), rows, two_i // 2, torch.get_num_threads())
    return out


# Every layer of a forward rotates at the same positions tensor (a new one each step): convert
# and bound-check it once, not once per layer (as RotaryEmbedding's cos/sin memo does).
_last_positions: tuple[torch.Tensor, int, torch.Tensor] | None = None


def _checked_positions(positions: torch.Tensor, num_rows: int) -> torch.Tensor:
    global _last_positions
    memo = _last_positions
    if memo is not None and memo[0] is positions and memo[1] == num_rows:
        return memo[2]
    pos = positions.to(torch.int64).contiguous()
    if pos.numel() and int(pos.max()) >= num_rows:
        raise ValueError(f"rotate_: position {int(pos.max())} beyond the cache's {num_rows}")
    _last_positions = (positions, num_rows, pos)
    return pos


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def _checked() -> bool:
    lib = cpu_kernels.library()
    if lib is None:
        return False
    gen = torch.Generator().manual_seed(0)
    x, res, w = (torch.randn(5, 40, generator=gen) for _ in range(3))
    w = w[0]
    want = F.rms_norm(x + res, (40,), w, 1e-6)
    got, got_res = add_rms_norm(x, res, w, 1e-6)  # type: ignore[misc]
    ok = torch.equal(got_res, x + res) and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    ok = ok and torch.allclose(add_rms_norm(x, None, w, 1e-6), F.rms_norm(x, (40,), w, 1e-6),  # type: ignore[arg-type]
                               rtol=1e-5, atol=1e-6)
    cos_sin = torch.randn(16, 8, generator=gen)
    pos = torch.tensor([3, 0, 15, 7, 7])
    qkv = torch.randn(5, 3 * 8 + 4, generator=gen)
    cos, sin = cos_sin[pos].unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = qkv[:, :24].view(5, 3, 8).chunk(2, dim=-1)
    want_rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).reshape(5, 24)
    rest = qkv[:, 24:].clone()
    rotate_(qkv, 3, 8, pos, cos_sin)
    ok = ok and torch.equal(qkv[:, :24], want_rot) and torch.equal(qkv[:, 24:], rest)
    gu = torch.randn(3, 2 * 37, generator=gen) * 6  # a vector body and a scalar tail per row
    gate, up = gu.chunk(2, dim=-1)
    ok = ok and torch.allclose(silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    if not ok:
        log.warning("the C RMSNorm / rotary / SiLU kernels disagree with torch; using the "
                    "torch ops")
    return bool(ok)
