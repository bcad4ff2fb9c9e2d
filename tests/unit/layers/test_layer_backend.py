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


@pytest.mark.parametrize("var,field", [("BATCHGEN_CPU_FUSED_OPS", "c_ops"),
                                       ("BATCHGEN_CPU_ATTENTION_KERNEL", "c_attention")])
def test_single_kernels_can_be_turned_off_for_tests(var: str, field: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(var, "0")
    assert getattr(LayerBackend.choose(CPU, torch.float32, head_dim=64), field) is False


def test_packed_layouts_can_be_turned_off_for_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHGEN_CPU_PACKED_LINEAR", "0")
    monkeypatch.setenv("BATCHGEN_CPU_SMALL_GEMM", "0")
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


def test_force_triton_is_scoped() -> None:
    assert not backend.use_triton(CPU)
    with backend.force_triton():
        assert backend.use_triton(CPU) == backend._triton_ok()
        with backend.force_triton(False):
            assert not backend.use_triton(CPU)
    assert not backend.use_triton(CPU)
