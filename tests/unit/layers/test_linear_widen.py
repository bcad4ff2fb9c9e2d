"""The "widen" layout (layers/linear.py): a bf16 / fp16 linear layer on a CPU kind where torch's
half GEMM is its slow reference one keeps its plain half weight once, multiplies a decode
step's few rows in the half dtype and widens the weight to fp32 for longer chunks. The oracle is
the product in float64, rounded once to the half dtype."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen_data.layers.backend import LayerBackend, building
from batchgen_data.layers.linear import WIDEN_MIN_ROWS, Linear

pytestmark = pytest.mark.cpu_kind


def _layer(dtype: torch.dtype, bias: bool) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as the loader builds a model in its dtype
    try:
        with building(LayerBackend(torch.device("cpu"), dtype, linear="widen")):
            lin = Linear(200, 96, bias=bias)
    finally:
        torch.set_default_dtype(prev)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lin.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    weight = lin.weight.detach().clone()
    b = None if lin.bias is None else lin.bias.detach().clone()
    lin.process_weights_after_loading()
    return lin, weight, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_widen_keeps_the_half_weight_once_and_matches_float64(dtype: torch.dtype,
                                                              bias: bool) -> None:
    lin, weight, b = _layer(dtype, bias)
    assert lin.packed is None and lin.weight.dtype == dtype  # one copy, in the half dtype
    for rows in (1, WIDEN_MIN_ROWS, WIDEN_MIN_ROWS + 1, 64, 300):
        x = torch.randn(rows, 200).to(dtype)
        got = lin(x)
        assert got.dtype == dtype and got.shape == (rows, 96)
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        # within one rounding of the half dtype (plus the fp32 sum's error) of the exact product
        torch.testing.assert_close(got.double(), exact, rtol=2 * torch.finfo(dtype).eps,
                                   atol=1e-3)


def test_a_decode_step_stays_in_the_half_dtype_and_a_chunk_widens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lin, _, _ = _layer(torch.bfloat16, bias=True)
    seen: list[torch.dtype] = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: (seen.append(w.dtype), real(x, w, b))[1])
    lin(torch.randn(2, WIDEN_MIN_ROWS // 2, 200).to(torch.bfloat16))  # leading dims count rows
    lin(torch.randn(WIDEN_MIN_ROWS + 1, 200).to(torch.bfloat16))
    assert seen == [torch.bfloat16, torch.float32]
