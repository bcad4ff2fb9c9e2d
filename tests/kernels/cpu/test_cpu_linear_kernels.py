"""The CPU matmul kernels of `kernels/cpu/linear.py`, each on its weight layout, against
F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen_data.kernels.cpu import build
from batchgen_data.kernels.cpu import linear as cpu_linear

from cpu_kernel_utils import needs_onednn, needs_panels, needs_small_gemm, torch_panels

pytestmark = pytest.mark.cpu_kind


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 33])
def test_onednn_linear_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    weight, b = torch.randn(160, 96), (torch.randn(160) if bias else None)
    packed = cpu_linear.pack_onednn(weight)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(cpu_linear.onednn_linear(x, packed, b), F.linear(x, weight, b),
                               rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, rows, 96)  # leading dims are flattened and restored
    got = cpu_linear.onednn_linear(x3, packed, b)
    assert got.shape == (2, rows, 160)
    torch.testing.assert_close(got, F.linear(x3, weight, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 65, 300])
@pytest.mark.parametrize("shape", [(160, 96), (53, 37), (48, 16), (5, 3)])
def test_panel_matmul_matches_f_linear(rows: int, bias: bool, shape: tuple[int, int]) -> None:
    # runs anywhere (torch's batched matmul on the panels): partial last panels, one panel
    torch.manual_seed(rows)
    out_f, in_f = shape
    weight, b = torch.randn(out_f, in_f), (torch.randn(out_f) if bias else None)
    panels = torch_panels(weight)
    x = torch.randn(2, rows, in_f)
    got = cpu_linear.panel_matmul(x, panels, b, out_f)
    assert got.shape == (2, rows, out_f) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="panel_matmul"):
        cpu_linear.panel_matmul(torch.randn(rows, in_f + 1), panels, b, out_f)


def test_panel_rows_are_the_weight_rows() -> None:
    weight = torch.randn(101, 24)
    ids = torch.tensor([0, 47, 48, 100, 5, 5])
    assert torch.equal(cpu_linear.panel_rows(torch_panels(weight), ids), weight[ids])


@needs_panels
def test_c_packing_is_the_panel_layout() -> None:
    weight = torch.randn(101, 37)
    assert torch.equal(cpu_linear.pack_panels(weight), torch_panels(weight))


@needs_small_gemm
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16])
@pytest.mark.parametrize("shape", [(160, 96), (37, 53), (6, 16), (5, 15), (576, 1536)])
def test_small_linear_matches_f_linear(rows: int, bias: bool, shape: tuple[int, int]) -> None:
    # weight-row tails (N % 6), masked K tails (K % 16), a single weight block, K below 16
    torch.manual_seed(rows)
    out_f, in_f = shape
    tol = 1e-4 * max(1.0, in_f / 256)  # sums of in_f products of N(0, 1) values
    weight = torch.randn(out_f, in_f)
    b = torch.randn(out_f) if bias else None
    x = torch.randn(rows, in_f)
    torch.testing.assert_close(cpu_linear.small_linear(x, weight, b), F.linear(x, weight, b),
                               rtol=1e-5, atol=tol)
    xt = torch.randn(in_f, rows).t()  # a non-contiguous input is copied first
    torch.testing.assert_close(cpu_linear.small_linear(xt, weight, b), F.linear(xt, weight, b),
                               rtol=1e-5, atol=tol)


@needs_small_gemm
def test_small_linear_rejects_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="small_linear"):
        cpu_linear.small_linear(torch.randn(2, 8), torch.randn(16, 4).t(), None)  # strided W
    with pytest.raises(ValueError, match="small_linear"):
        cpu_linear.small_linear(torch.randn(2, 8), torch.randn(4, 9), None)  # K mismatch


@needs_panels
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 17, 64])
@pytest.mark.parametrize("shape", [(160, 96), (53, 37), (48, 16), (5, 3), (576, 1536)])
def test_panel_linear_matches_f_linear(rows: int, bias: bool, shape: tuple[int, int]) -> None:
    # partial last panels (N % 48), a single panel, K below 16, row tiles of 8 and their tails
    torch.manual_seed(rows)
    out_f, in_f = shape
    tol = 1e-4 * max(1.0, in_f / 256)
    weight = torch.randn(out_f, in_f)
    b = torch.randn(out_f) if bias else None
    panels = cpu_linear.pack_panels(weight)
    x = torch.randn(rows, in_f)
    torch.testing.assert_close(cpu_linear.panel_linear(x, panels, b, out_f), F.linear(x, weight, b),
                               rtol=1e-5, atol=tol)
    xt = torch.randn(in_f, rows).t()
    torch.testing.assert_close(cpu_linear.panel_linear(xt, panels, b, out_f),
                               F.linear(xt, weight, b), rtol=1e-5, atol=tol)
    with pytest.raises(ValueError, match="panel_linear"):
        cpu_linear.panel_linear(torch.randn(rows, in_f + 1), panels, b, out_f)


def test_c_matmuls_need_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    build.library.cache_clear()
    cpu_linear._small_gemm_checked.cache_clear()
    cpu_linear._panel_gemm_checked.cache_clear()
    try:
        assert not cpu_linear.small_gemm_available() and not cpu_linear.panel_gemm_available()
    finally:
        build.library.cache_clear()
        cpu_linear._small_gemm_checked.cache_clear()
        cpu_linear._panel_gemm_checked.cache_clear()
