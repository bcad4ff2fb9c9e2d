"""The weight-only quantized matmul (`kernels/cpu/quant.py`, csrc/quant_gemm.c) against the torch
reference (`kernels/reference.py`): INT8, INT4 and FP8 codes, per channel and per group (group
sizes that do not divide the row, odd ones that split an INT4 byte), stored zeros or the
default, odd shapes, 1-64 rows in C and more through dequantize + MKL, and zero / extreme
codes. `make test` runs it on the AVX2 build too (the CPU-kind passes, docs/cpu.md)."""
from __future__ import annotations

import pytest
import torch

from batchgen_data.kernels import reference
from batchgen_data.kernels.cpu import quant as cpu_quant
from kernel_test_utils import assert_close_sum

pytestmark = pytest.mark.cpu_kind

needs_quant = pytest.mark.skipif(not cpu_quant.available(),
                                 reason="no C compiler or no AVX2/FMA here")


def _weights(kind: str, n: int, k: int, group: int, zeros: bool, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    codes = cpu_quant.random_codes(kind, n, k, gen)
    g = -(-k // group)
    scales = torch.rand(n, g, generator=gen) + 0.05
    zero = torch.rand(n, g, generator=gen) * 6 if zeros else None
    return codes, scales, zero


@needs_quant
@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("n, k, group", [(37, 53, 53), (64, 576, 128), (48, 100, 24),
                                         (9, 7, 3), (16, 100, 33), (5, 40, 40), (130, 96, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 64, 65])
def test_quant_linear_matches_reference(kind: str, n: int, k: int, group: int, rows: int) -> None:
    for zeros in ((False, True) if kind != "fp8" else (False,)):
        codes, scales, zero = _weights(kind, n, k, group, zeros, seed=n * k + rows)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        want = reference.quant_linear(x, codes, scales, zero, kind, group)
        got = cpu_quant.quant_linear(x, codes, scales, zero, kind, group)
        # summands are x * w with |w| up to (code range) * scale
        assert_close_sum(got, want, k, scale=float((x.abs().max() * scales.max()).item()) * 16)


@needs_quant
@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("n, k, group", [(37, 53, 20), (9, 7, 3), (64, 576, 576)])
def test_dequantize_is_exact(kind: str, n: int, k: int, group: int) -> None:
    for zeros in (False, True):
        codes, scales, zero = _weights(kind, n, k, group, zeros and kind != "fp8", seed=k)
        torch.testing.assert_close(cpu_quant.dequantize(codes, scales, zero, kind, group, k),
                                   reference.dequantize(codes, scales, zero, kind, group, k),
                                   rtol=0, atol=0)


@needs_quant
def test_extreme_codes() -> None:
    n, k = 8, 96
    x = torch.randn(3, k)
    s = torch.ones(n, 1)
    cases = {"int8": [torch.full((n, k), v, dtype=torch.int8) for v in (-128, 127, 0)],
             "int4": [torch.full((n, k // 2), v, dtype=torch.uint8) for v in (0x00, 0xFF, 0x88)],
             # largest normal, smallest subnormal, zero, negative zero (e4m3fn bit patterns)
             "fp8": [torch.full((n, k), v, dtype=torch.uint8) for v in (0x7E, 0xFE, 0x01, 0x00,
                                                                         0x80)]}
    for kind, all_codes in cases.items():
        for codes in all_codes:
            want = reference.quant_linear(x, codes, s, None, kind, k)
            got = cpu_quant.quant_linear(x, codes, s, None, kind, k)
            assert_close_sum(got, want, k, scale=float(x.abs().max()) * 448)
            w = reference.dequantize(codes, s, None, kind, k, k)
            assert torch.equal(cpu_quant.dequantize(codes, s, None, kind, k, k), w)
    # the fp8 patterns decode to the values float8_e4m3fn gives them
    assert reference.dequantize(torch.tensor([[0x7E, 0x01]], dtype=torch.uint8),
                                torch.ones(1, 1), None, "fp8", 2, 2).tolist() == [[448.0, 2**-9]]


@needs_quant
def test_launcher_rejects_mismatched_inputs() -> None:
    codes, scales, _ = _weights("int4", 8, 32, 16, False, 0)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="codes"):
        cpu_quant.quant_linear(x, codes[:, :8].contiguous(), scales, None, "int4", 16)
    with pytest.raises(ValueError, match="scales"):
        cpu_quant.quant_linear(x, codes, scales[:, :1].contiguous(), None, "int4", 16)
    with pytest.raises(ValueError, match="float32"):
        cpu_quant.quant_linear(x.double(), codes, scales, None, "int4", 16)
