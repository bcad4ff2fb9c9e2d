"""silu_and_mul launcher vs. the torch reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchgen_data.kernels import reference, silu_and_mul  # noqa: E402
from kernel_test_utils import assert_close  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 32), (7, 200)])
def test_matches_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    x = torch.randn(shape).to(dtype)
    out = silu_and_mul(x)
    assert out.shape == (shape[0], shape[1] // 2) and out.dtype == dtype
    assert_close(out, reference.silu_and_mul(x))


def test_strided_rows() -> None:
    wide = torch.randn(5, 96)
    x = wide[:, :64]  # row stride 96, last dim contiguous
    assert_close(silu_and_mul(x), reference.silu_and_mul(x.contiguous()))


def test_reference_formula() -> None:
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    expected = torch.tensor([[1.0 / (1 + torch.e**-1) * 3.0, -2.0 / (1 + torch.e**2) * 0.5]])
    torch.testing.assert_close(reference.silu_and_mul(x), expected)


@pytest.mark.parametrize(
    "x, match",
    [
        (torch.randn(4, 33), "even"),
        (torch.randn(4, 32).to(torch.int32), "dtype"),
        (torch.randn(2, 4, 32), "2 dims"),
        (torch.randn(32, 4).t(), "stride 1"),
    ],
)
def test_validation(x: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        silu_and_mul(x)
