"""Triton quantized matmuls (`kernels/quant_matmul.py`) against the torch references, under the
interpreter in fp32 / fp16: weight-only INT8 / INT4 / FP8 codes with group scales (group sizes
that do not divide K, stored zeros or not, odd shapes, extreme codes), per-token-group FP8
activation quantization, and FP8 W8A8 with block-scaled weights."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchgen_data.kernels import (fp8_block_matmul_quantized,  # noqa: E402
                                   per_token_group_quant_fp8, quant_linear, reference)
from batchgen_data.kernels.cpu.quant import random_codes  # noqa: E402
from kernel_test_utils import assert_close_sum  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("m, n, k, group", [(1, 33, 64, 64), (5, 48, 100, 24), (17, 20, 37, 7)])
def test_weight_only_matches_reference(dtype: torch.dtype, kind: str, m: int, n: int, k: int,
                                       group: int) -> None:
    g = -(-k // group)
    codes = random_codes(kind, n, k)
    scales = (torch.rand(n, g) + 0.05) / (64 if kind == "fp8" else 4)
    for zeros in ((None, torch.rand(n, g) * 6) if kind != "fp8" else (None,)):
        x = torch.randn(m, k).to(dtype)
        got = quant_linear(x, codes, scales, zeros, kind, group)
        want = reference.quant_linear(x, codes, scales, zeros, kind, group)
        assert got.dtype == dtype and got.shape == (m, n)
        assert_close_sum(got, want, k,
                         scale=float(scales.max()) * (448 if kind == "fp8" else 128))


def test_weight_only_extreme_codes() -> None:
    x = torch.randn(3, 40)
    ones = torch.ones(16, 1)
    for kind, value in (("int8", -128), ("int8", 127), ("int4", 0xFF), ("int4", 0x00),
                        ("fp8", 0x7E)):
        width = 20 if kind == "int4" else 40
        codes = torch.full((16, width), value & 0xFF, dtype=torch.uint8)
        if kind == "int8":
            codes = codes.view(torch.int8)
        got = quant_linear(x, codes, ones, None, kind, 40)
        assert_close_sum(got, reference.quant_linear(x, codes, ones, None, kind, 40), 40,
                         scale=448)


def test_weight_only_rejects_mismatched_inputs() -> None:
    codes = random_codes("int4", 8, 32)
    with pytest.raises(ValueError, match="codes"):
        quant_linear(torch.randn(2, 32), codes[:, :4].contiguous(), torch.ones(8, 2), None,
                     "int4", 16)
    with pytest.raises(ValueError, match="scales"):
        quant_linear(torch.randn(2, 32), codes, torch.ones(8, 3), None, "int4", 16)


@pytest.mark.parametrize("m, k, group", [(3, 64, 32), (5, 100, 32)])
def test_per_token_group_quant_fp8(m: int, k: int, group: int) -> None:
    x = torch.randn(m, k) * 5
    q, s = per_token_group_quant_fp8(x, group)
    rq, rs = reference.per_token_group_quant_fp8(x, group)
    torch.testing.assert_close(s, rs)
    # Triton's interpreter rounds fp32 -> e4m3 wrongly where a value rounds up into the next
    # power of two (126.8 -> 64; torch and the hardware give 128): compare the others exactly
    v = (x / s.repeat_interleave(group, 1)[:, :k]).abs()
    mantissa = v / torch.exp2(torch.floor(torch.log2(v.clamp(min=2**-9))))
    away = mantissa < 1.875
    assert away.float().mean() > 0.8
    torch.testing.assert_close(q.float()[away], rq.float()[away], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k, block", [(4, 48, 64, (16, 32)), (9, 40, 96, (32, 32)),
                                            (3, 20, 80, (16, 32))])
def test_fp8_block_matmul_matches_reference(dtype: torch.dtype, m: int, n: int, k: int,
                                            block: tuple[int, int]) -> None:
    w = (torch.randn(n, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.rand(-(-n // block[0]), -(-k // block[1])) / 100 + 1e-3
    # activations quantized by the reference (torch's rounding), so the matmul is compared alone
    xq, xs = reference.per_token_group_quant_fp8(torch.randn(m, k) * 3, block[1])
    got = fp8_block_matmul_quantized(xq, xs, w, ws, block, dtype)
    want = reference.fp8_block_matmul_quantized(xq, xs, w, ws, block, dtype)
    assert got.dtype == dtype
    assert_close_sum(got, want, k, scale=float(want.abs().max()) / 4)
