"""`kernels/cpu/isa.py` and `capability.py`: the C kernels' ISA from the CPU's flags capped by
``BATCHGEN_CPU_ISA``, checked against a hand-written table and against what the built library
itself reports; oneDNN's and torch's answers per dtype; refusals that name the CPU feature."""
from __future__ import annotations

import pytest
import torch

from batchgen_data.kernels.cpu import build, capability, ops
from batchgen_data.kernels.cpu import isa as cpu_isa
from batchgen_data.kernels.cpu import linear as cpu_linear

from cpu_kernel_utils import kernels_built_for, needs_cc, on_x86

pytestmark = pytest.mark.cpu_kind

AVX512_BOX = {"sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl",
              "avx512cd", "avx512_bf16", "amx_bf16"}
AVX2_BOX = {"sse4_2", "avx", "avx2", "fma", "f16c"}  # the AMD EPYC the suite failed on
OLD_BOX = {"sse4_2", "avx"}


@pytest.mark.parametrize("flags,cap,isa,march", [
    (AVX512_BOX, None, "avx512", None),
    (AVX512_BOX, "avx512", "avx512", None),
    (AVX512_BOX, "avx2", "avx2", "x86-64-v3"),
    (AVX512_BOX, "none", "none", None),
    (AVX512_BOX - {"avx512bw"}, None, "avx2", None),  # AVX-512F alone is not the avx512 level
    (AVX2_BOX, None, "avx2", None),
    (AVX2_BOX, "avx512", "avx2", None),  # a cap above the CPU changes nothing
    (AVX2_BOX, "AVX2", "avx2", None),
    (OLD_BOX, "avx2", "baseline", None),
])
def test_the_kernel_isa_is_the_cpu_level_under_the_cap(flags: set[str], cap: str | None,
                                                       isa: str, march: str | None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu_isa, "_x86", lambda: True)
    if cap is None:
        monkeypatch.delenv("BATCHGEN_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("BATCHGEN_CPU_ISA", cap)
    assert (cpu_isa.kernel_isa(), cpu_isa.kernel_march()) == (isa, march)


def test_off_x86_there_is_only_the_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset(AVX512_BOX))
    monkeypatch.setattr(cpu_isa, "_x86", lambda: False)
    monkeypatch.setenv("BATCHGEN_CPU_ISA", "avx2")
    assert (cpu_isa.native_isa(), cpu_isa.kernel_march()) == ("baseline", None)


def test_an_unknown_isa_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHGEN_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="BATCHGEN_CPU_ISA='sse9'.*avx2"):
        cpu_isa.kernel_isa()


def test_the_refusal_names_the_flags_a_cpu_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset(AVX2_BOX))
    assert cpu_isa.missing("avx512") == ["avx512f", "avx512bw", "avx512dq", "avx512vl"]
    assert "avx512f, avx512bw" in capability.needs("avx512")


@needs_cc
def test_the_built_library_holds_the_level_it_was_built_for() -> None:
    # its own answer (which kernels it holds) against the level the flags and the cap chose
    assert capability.built_isa() == cpu_isa.kernel_isa()


@needs_cc
@on_x86
def test_an_avx2_build_refuses_panels_naming_avx512(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with kernels_built_for("avx2", tmp_path):
        assert capability.built_isa() == "avx2"
        assert cpu_linear.rows_gemm_available() and not cpu_linear.panel_gemm_available()
        with pytest.raises(ValueError, match="pack_panels: .*(avx512f|AVX512)"):
            cpu_linear.pack_panels(torch.randn(50, 16))


def test_isa_none_keeps_every_c_kernel_out(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with kernels_built_for("none", tmp_path):
        assert build.library() is None and capability.built_isa() == "none"
        assert not (ops.available() or cpu_linear.rows_gemm_available()
                    or cpu_linear.panel_gemm_available())


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_onednn_bf16_packing_agrees_with_torchs_own_device_check() -> None:
    # two answers from two places: packing a weight here, torch's bf16 device check there
    assert capability.onednn(torch.bfloat16).ok == capability.half_matmul_fast(torch.bfloat16)
    assert capability.onednn(torch.float32).ok
    assert not capability.onednn(torch.float16).ok  # the engine does not pack fp16


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_packing_bf16_without_onednns_path_is_refused_by_feature(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the text is oneDNN's own; here the answer is forced to what an AVX2-only CPU gets
    # (tests/integration/test_cpu_kinds.py gets it from oneDNN under ONEDNN_MAX_CPU_ISA=AVX2)
    no = capability.Support(False, "oneDNN: bf16 path needs the cpu support avx_ne_convert or "
                                   "avx512bw, avx512vl and avx512dq")
    monkeypatch.setattr(capability, "onednn", lambda dtype: no)
    with pytest.raises(ValueError, match="pack_onednn: .*bfloat16.*avx512bw"):
        cpu_linear.pack_onednn(torch.randn(8, 8, dtype=torch.bfloat16))
    assert not cpu_linear.onednn_available(torch.bfloat16)


def test_the_report_says_what_each_layer_runs() -> None:
    got = capability.report()
    assert got["c_kernels"] == cpu_isa.kernel_isa() and got["aten"] == capability.aten()
    assert got["onednn_bf16"].startswith("yes" if capability.onednn(torch.bfloat16).ok else "no (")
    assert set(got) == {"cpu", "aten", "c_kernels", "c_kernels_built", "onednn_fp32",
                        "onednn_bf16", "torch_bf16_matmul", "torch_fp16_matmul"}
