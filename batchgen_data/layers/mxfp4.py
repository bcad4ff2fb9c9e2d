"""MXFP4 weights (OCP Microscaling FP4), as gpt-oss's checkpoints store its experts, and the
matmul over them.

The format (OCP Microscaling Formats spec v1.0): values in blocks of 32 sharing one scale; each
value an FP4 E2M1 code (sign, two exponent bits with bias 1, one mantissa bit: +-0, 0.5, 1, 1.5,
2, 3, 4, 6), the scale an E8M0 byte meaning 2^(s - 127) (255 is NaN). A gpt-oss checkpoint keeps,
per expert projection, `<proj>_blocks` uint8 [E, N, K / 32, 16] (two codes a byte, the even
column in the low nibble) and `<proj>_scales` uint8 [E, N, K / 32]. Layers hold them as they are,
flattened to `blocks` [E, N, K / 2] and `scales` [E, N, K / 32]: half a byte a value plus a byte
per 32, a quarter of bf16's bytes.

The matmul is chosen when the layer is built: the Triton kernel decodes each tile of codes in
its K loop (`kernels/mxfp4.py`); elsewhere one expert's matrix is decoded to the activations'
dtype and multiplied (`kernels/reference.py: mxfp4_dequantize`), so only the experts a step
routes to are ever widened, one at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen_data.kernels import reference

BLOCK = reference.MXFP4_BLOCK


def check_stored(name: str, blocks: torch.Tensor, scales: torch.Tensor, rows: int,
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's (blocks [E, rows, K/32, 16] or [E, rows, K/2], scales [E, rows, K/32])
    as the layer stores them; ValueError naming `name` when they do not describe [E, rows, k]."""
    if k % BLOCK:
        raise ValueError(f"{name}: MXFP4 needs the input width ({k}) to be a multiple of {BLOCK}")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales are uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.dim() == 4:
        blocks = blocks.reshape(*blocks.shape[:2], -1)
    if blocks.shape[1:] != (rows, k // 2) or scales.shape[1:] != (rows, k // BLOCK) \
            or scales.shape[0] != blocks.shape[0]:
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} do not describe [E, {rows}, {k}]")
    return blocks, scales


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [..., N, K/2], scales [..., N, K/32]) nearest to w [..., N, K]: each block's
    scale the power of two that puts its largest magnitude at or under 6 (E2M1's largest), each
    value rounded to the nearest code. For building test checkpoints and for re-quantizing a
    dense model; not a calibrated quantizer."""
    *lead, n, k = w.shape
    blocks = w.float().reshape(*lead, n, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp_min(2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exp).unsqueeze(-1)
    grid = torch.tensor(reference.FP4_E2M1, device=w.device)
    codes = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1)  # [..., G, 32] 0..7
    codes = codes | ((scaled < 0).long() << 3)
    codes = codes.reshape(*lead, n, k).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8)


def linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
           bias: torch.Tensor | None, triton: bool) -> torch.Tensor:
    """x [T, K] @ W^T + bias for one MXFP4 matrix W [N, K] (`blocks` [N, K/2], `scales`
    [N, K/32]) -> [T, N] in x's dtype; `triton`: the layer's backend, fixed at build."""
    if triton:
        from batchgen_data.kernels import mxfp4_linear
        return mxfp4_linear(x.contiguous(), blocks, scales, bias)
    w = reference.mxfp4_dequantize(blocks, scales).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))
