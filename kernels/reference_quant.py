"""Plain-PyTorch references for the quantized matmuls: weight-only int8 / int4 / fp8 codes,
fp8 block-scaled weights with per-token-group activations, and MXFP4 (OCP microscaling FP4)
experts. Same contract as `reference.py` (which re-exports them, so callers have one namespace
of references): each matches its Triton launcher's name, signature and semantics, computes in
float32 and casts back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# ---- weight-only quantized matmuls (kernels/cpu/csrc/quant_gemm.c, layers/quant.py) ------------
QUANT_KINDS = ("int8", "int4", "fp8")
DEFAULT_ZERO = {"int8": 0.0, "int4": 8.0, "fp8": 0.0}


def quant_codes(codes: torch.Tensor, kind: str, k: int) -> torch.Tensor:
    """The stored codes of a quantized weight as float32 [N, k]: int8 as they are, int4 from
    two per byte (even column in the low nibble), fp8 from its float8_e4m3fn bit patterns."""
    if kind == "int8":
        return codes.view(torch.int8).float()
    if kind == "int4":
        b = codes.view(torch.uint8)
        both = torch.stack((b & 15, b >> 4), dim=-1).reshape(b.shape[0], -1)  # [N, 2*ceil(k/2)]
        return both[:, :k].float()
    if kind == "fp8":
        return codes.view(torch.float8_e4m3fn).float()
    raise ValueError(f"kind={kind!r}: use one of {QUANT_KINDS}")


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               kind: str, group: int, k: int) -> torch.Tensor:
    """w [N, k] float32 = (code - zero) * scale, with one scale (and zero) [N, G] per `group`
    columns, G = ceil(k / group); the last group may be short. `zeros` None: the kind's
    `DEFAULT_ZERO`."""
    q = quant_codes(codes, kind, k)
    index = torch.arange(k, device=q.device) // group  # [k] the group of each column
    s = scales.float()[:, index]
    z = DEFAULT_ZERO[kind] if zeros is None else zeros.float()[:, index]
    return (q - z) * s


def quant_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, kind: str, group: int) -> torch.Tensor:
    """x [..., k] @ dequantize(...)^T in float32, cast back to x's dtype."""
    w = dequantize(codes, scales, zeros, kind, group, x.shape[-1])
    return F.linear(x.float(), w).to(x.dtype)


def per_token_group_quant_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q float8_e4m3fn [M, K], scales fp32 [M, ceil(K / group)]): amax / 448 per token and
    `group` columns."""
    m, k = x.shape
    g = -(-k // group)
    xp = F.pad(x.float(), (0, g * group - k)).view(m, g, group)
    scale = xp.abs().amax(-1).clamp(min=1e-10) / 448.0
    q = (xp / scale[..., None]).view(m, -1)[:, :k].to(torch.float8_e4m3fn)
    return q, scale


def fp8_block_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     block: tuple[int, int]) -> torch.Tensor:
    """FP8 W8A8 with block-scaled weights [N, K] (scales per `block` [rows, cols]) and dynamic
    per-token-group activations: both dequantized in fp32, multiplied, cast to x's dtype."""
    xq, xs = per_token_group_quant_fp8(x, block[1])
    return fp8_block_matmul_quantized(xq, xs, weight, weight_scale, block, x.dtype)


def fp8_block_matmul_quantized(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor,
                               weight_scale: torch.Tensor, block: tuple[int, int],
                               out_dtype: torch.dtype) -> torch.Tensor:
    """`fp8_block_matmul` on activations already quantized (e4m3 [M, K], scales [M, G])."""
    n, k = weight.shape
    bn, bk = block
    cols = torch.arange(k, device=xq.device) // bk
    xd = xq.float() * xs[:, cols]
    wd = weight.float() * weight_scale.repeat_interleave(bn, 0)[:n][:, cols]
    return (xd @ wd.t()).to(out_dtype)


# ---- MXFP4 weights (OCP Microscaling FP4: gpt-oss's experts; layers/mxfp4.py, mxfp4.py) ------
# E2M1 values of codes 0..7 (bit 3 is the sign): two exponent bits with bias 1, one mantissa bit
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_BLOCK = 32  # values sharing one E8M0 scale


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., N, K]`` from ``blocks`` uint8 ``[..., N, K / 2]`` (two E2M1 codes a
    byte, the even column in the low nibble) and ``scales`` uint8 ``[..., N, K / 32]`` (E8M0:
    2^(s - 127), 255 NaN)."""
    # one gather per byte (both of its values) and one per scale, then one product: the
    # products are exact (a power of two times a short mantissa) except past float32's range
    pairs, powers = _mxfp4_tables(blocks.device)
    vals = pairs[blocks.long()]  # [..., N, K/2, 2]
    vals = vals.view(*scales.shape, MXFP4_BLOCK)  # [..., N, G, 32]
    out = vals * powers[scales.long()].unsqueeze(-1)
    return out.view(*scales.shape[:-1], -1)


def _mxfp4_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the two E2M1 values of each byte [256, 2], low nibble first; 2^(s - 127) of each E8M0
    byte [256], 255 NaN), float32."""
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=device)
    lut = torch.cat([lut, -lut])
    b = torch.arange(256, device=device)
    pairs = torch.stack((lut[b & 15], lut[b >> 4]), dim=-1)
    powers = torch.ldexp(torch.ones(256, device=device), (b - 127).float())
    powers[255] = float("nan")
    return pairs, powers


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x ``[M, K]`` @ mxfp4_dequantize(blocks, scales)^T (+ bias ``[N]``) in float32, cast back
    to x's dtype."""
    w = mxfp4_dequantize(blocks, scales)
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)
