"""MXFP4 (OCP Microscaling FP4) weights: the torch dequantization against a decoder written from
the format's definition (bit by bit, one value at a time), the quantizer's round trip, and the
Triton matmul that decodes in its K loop against the torch reference (fp32 / fp16, with and
without bias, ragged M and N) under TRITON_INTERPRET=1."""
from __future__ import annotations

import math

import pytest
import torch

from batchgen_data.kernels import mxfp4_linear, reference
from batchgen_data.layers import mxfp4


def spec_e2m1(code: int) -> float:
    """OCP MX spec, FP4 E2M1: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0
    is subnormal (2^0 * 0.m), no infinities or NaNs."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m / 2 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def spec_e8m0(byte: int) -> float:
    """E8M0: 2^(byte - 127), 0xFF NaN."""
    return math.nan if byte == 255 else math.ldexp(1.0, byte - 127)


def spec_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, half = blocks.shape
    out = torch.empty(n, 2 * half, dtype=torch.float64)
    for r in range(n):
        for j in range(half):
            byte = int(blocks[r, j])
            for nib, col in ((byte & 15, 2 * j), (byte >> 4, 2 * j + 1)):
                out[r, col] = spec_e2m1(nib) * spec_e8m0(int(scales[r, col // 32]))
    return out


def test_dequantize_matches_the_spec_for_every_byte() -> None:
    # every byte value in every position, scales from the smallest to NaN
    blocks = torch.arange(256, dtype=torch.uint8).view(8, 32)
    scales = torch.tensor([[0, 1], [100, 126], [127, 128], [140, 200], [254, 3], [60, 255],
                           [127, 127], [5, 250]], dtype=torch.uint8)
    got = reference.mxfp4_dequantize(blocks, scales)
    want = spec_dequantize(blocks, scales).float()  # 6 * 2^127 and its like overflow float32
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    # the low nibble is the even column: byte 0x21 is (0.5, 1.0) at scale 1
    one = reference.mxfp4_dequantize(torch.full((1, 16), 0x21, dtype=torch.uint8),
                                     torch.tensor([[127]], dtype=torch.uint8))
    assert one[0, :2].tolist() == [0.5, 1.0]


def test_quantize_round_trips_representable_weights() -> None:
    blocks = torch.randint(0, 256, (2, 6, 32), dtype=torch.uint8)
    scales = torch.randint(110, 140, (2, 6, 2), dtype=torch.uint8)
    w = reference.mxfp4_dequantize(blocks, scales)  # [2, 6, 64]
    b2, s2 = mxfp4.quantize(w)
    assert b2.shape == blocks.shape and s2.shape == scales.shape
    assert torch.equal(reference.mxfp4_dequantize(b2, s2), w)
    # a random weight lands within half a step of E2M1's grid at its block's scale
    dense = torch.randn(4, 96)
    back = reference.mxfp4_dequantize(*mxfp4.quantize(dense))
    step = torch.exp2(torch.ceil(torch.log2(dense.view(4, 3, 32).abs().amax(-1) / 6)))
    assert ((back - dense).abs().view(4, 3, 32) <= step.unsqueeze(-1) + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k, bias", [(1, 32, 64, True), (5, 40, 96, False),
                                           (17, 70, 128, True)])
def test_triton_matches_reference(dtype: torch.dtype, m: int, n: int, k: int, bias: bool) -> None:
    blocks = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scales = torch.randint(120, 132, (n, k // 32), dtype=torch.uint8)
    x = torch.randn(m, k).to(dtype)
    b = torch.randn(n) if bias else None
    got = mxfp4_linear(x, blocks, scales, b)
    want = reference.mxfp4_linear(x, blocks, scales, b)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 8)
    # the layer's two paths agree too
    torch.testing.assert_close(mxfp4.linear(x, blocks, scales, b, triton=True).float(),
                               mxfp4.linear(x, blocks, scales, b, triton=False).float(),
                               rtol=tol, atol=tol * 8)


def test_triton_decodes_the_extreme_scales() -> None:
    """Scale bytes 0 (2^-127, the one subnormal) and 254, and a NaN block, as the reference."""
    blocks = torch.randint(0, 256, (3, 32), dtype=torch.uint8)
    scales = torch.tensor([[0, 0], [254, 1], [127, 255]], dtype=torch.uint8)
    x = torch.zeros(2, 64)
    x[:, :32] = torch.randn(2, 32) * 1e-30  # keeps the large scale's row finite
    got = mxfp4_linear(x, blocks, scales)
    want = reference.mxfp4_linear(x, blocks, scales)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(torch.nan_to_num(got), torch.nan_to_num(want), rtol=1e-4,
                               atol=0.0)


def test_launcher_refuses_mismatched_inputs() -> None:
    blocks = torch.zeros(4, 32, dtype=torch.uint8)
    scales = torch.zeros(4, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_linear(torch.zeros(1, 48), blocks, scales)
    with pytest.raises(ValueError, match="scales"):
        mxfp4_linear(torch.zeros(1, 64), blocks, scales[:, :1])
    with pytest.raises(ValueError, match="blocks"):
        mxfp4_linear(torch.zeros(1, 64), blocks.float(), scales)
