"""`LayerBackend.choose` picks each layer family's implementation once, from the device, the
dtype, the engine's `cpu_kernels` setting and the test-hook variables."""
from __future__ import annotations

import pytest
import torch

from batchgen_data.kernels.cpu import attention, capability, linear, ops
from batchgen_data.layers import backend
from batchgen_data.layers.backend import LayerBackend, building, current
from batchgen_data.layers.norm import RMSNorm

pytestmark = pytest.mark.cpu_kind

CPU = torch.device("cpu")


def test_cpu_kernels_off_is_torch_only() -> None:
    b = LayerBackend.choose(CPU, torch.float32, cpu_kernels=False, head_dim=64)
    assert (b.triton, b.c_ops, b.c_attention, b.linear) == (False, False, False, "plain")
    assert b.torch_decode_attention


def test_fp32_cpu_takes_every_kernel_that_runs_here() -> None:
    b = LayerBackend.choose(CPU, torch.float32, head_dim=64)
    assert b.c_ops == ops.available()
    assert b.c_attention == attention.supports(64)
    want = ("panels" if linear.panel_gemm_available()
            else "rows" if linear.rows_gemm_available()
            else "onednn" if linear.onednn_available() else "plain")
    assert b.linear == want
    assert not LayerBackend.choose(CPU, torch.float32, head_dim=48).c_attention  # no such kernel


def test_other_dtypes_keep_torch_ops() -> None:
    # half weights: oneDNN's packed bf16 where oneDNN has that path on this CPU kind, else
    # plain where torch's own half matmuls are fast, else widened to fp32 for prefill
    half = LayerBackend.choose(CPU, torch.float16, head_dim=64)
    fast16 = capability.half_matmul_fast(torch.float16)
    assert (half.c_ops, half.c_attention, half.linear) == (False, False,
                                                           "plain" if fast16 else "widen")
    bf16 = LayerBackend.choose(CPU, torch.bfloat16, head_dim=64)
    want = ("onednn" if capability.onednn(torch.bfloat16).ok
            else "plain" if capability.half_matmul_fast(torch.bfloat16) else "widen")
    assert not bf16.c_ops and bf16.linear == want


@pytest.mark.parametrize("name,field", [("ops.available", "c_ops"),
                                        ("attention.supports", "c_attention")])
def test_a_kernel_this_cpu_lacks_is_not_chosen(name: str, field: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"batchgen_data.kernels.cpu.{name}", lambda *a: False)
    assert getattr(LayerBackend.choose(CPU, torch.float32, head_dim=64), field) is False


def test_without_packed_layouts_linear_is_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen_data.kernels.cpu import linear

    for name in ("onednn_available", "panel_gemm_available", "rows_gemm_available"):
        monkeypatch.setattr(linear, name, lambda *a: False)
    assert LayerBackend.choose(CPU, torch.float32, head_dim=64).linear == "plain"


def test_layers_read_the_backend_they_are_built_in() -> None:
    assert current().linear == "plain" and not current().c_ops  # outside a build: torch
    chosen = LayerBackend(CPU, torch.float32, c_ops=True)
    with building(chosen):
        assert current() is chosen
        norm = RMSNorm(8, 1e-6)
    assert norm._forward == norm._c
    outside = RMSNorm(8, 1e-6)
    assert outside._forward == outside._torch


def test_triton_on_the_cpu_only_when_asked() -> None:
    assert not backend.use_triton(CPU)
    assert not LayerBackend.choose(CPU, torch.float32, head_dim=64).triton
    assert LayerBackend.choose(CPU, torch.float32, head_dim=64, triton=True).triton \
        == backend._triton_ok()
    assert not LayerBackend.choose(CPU, torch.float32, head_dim=64, triton=False).triton
