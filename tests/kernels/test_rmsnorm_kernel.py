"""rms_norm / fused_add_rms_norm launchers vs. the torch reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchgen_data.kernels import fused_add_rms_norm, reference, rms_norm  # noqa: E402
from kernel_test_utils import assert_close  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 96)])
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = (torch.randn(shape) * 3).to(dtype)
    weight = torch.randn(shape[-1]).to(dtype)
    out = rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, reference.rms_norm(x, weight, 1e-5))


def test_rms_norm_reference_formula() -> None:
    x = torch.tensor([[3.0, 4.0]])
    # mean square 12.5 -> x / sqrt(12.5), then times weight
    expected = torch.tensor([[3.0, 8.0]]) / 12.5**0.5
    torch.testing.assert_close(reference.rms_norm(x, torch.tensor([1.0, 2.0]), 0.0), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_add_in_place(dtype: torch.dtype) -> None:
    x = torch.randn(4, 80).to(dtype)
    residual = torch.randn(4, 80).to(dtype)
    weight = torch.rand(80).to(dtype) + 0.5
    exp_x, exp_res = reference.fused_add_rms_norm(x.clone(), residual.clone(), weight)
    out_x, out_res = fused_add_rms_norm(x, residual, weight)
    assert out_x is x and out_res is residual
    assert_close(residual, exp_res)
    assert_close(x, exp_x)
    assert_close(exp_x, reference.rms_norm(exp_res, weight))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: rms_norm(torch.randn(2, 8), torch.randn(9)), "weight must have shape"),
        (lambda: rms_norm(torch.randn(8, 2).t(), torch.randn(8)), "contiguous"),
        (lambda: rms_norm(torch.randn(2, 8).long(), torch.randn(8)), "dtype"),
        (lambda: rms_norm(torch.randn(2, 8), torch.randn(8), eps=0.0), "eps"),
        (
            lambda: fused_add_rms_norm(torch.randn(2, 8), torch.randn(2, 8).half(), torch.randn(8)),
            "residual dtype",
        ),
        (
            lambda: fused_add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8)),
            "residual must have shape",
        ),
    ],
)
def test_validation(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
