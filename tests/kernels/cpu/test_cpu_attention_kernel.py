"""The compiled C decode-attention kernel (`kernels/cpu/attention.py`) against dense attention."""
from __future__ import annotations

import pytest
import torch

from batchgen_data.kernels.cpu import attention as cpu_attention
from batchgen_data.kernels.cpu import build, linear as cpu_linear

from cpu_kernel_utils import kernels_built_for, needs_cc, on_x86, reference_decode

pytestmark = pytest.mark.cpu_kind


@needs_cc
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(16, 4, 2), (32, 4, 4), (64, 9, 3), (128, 8, 1)])
def test_c_decode_kernel_matches_dense_attention(head_dim: int, heads: int, kv_heads: int,
                                                 bs: int) -> None:
    torch.manual_seed(head_dim)
    width = -(-700 // bs)
    num_blocks = 8 * width
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim)
    # block edges, 16-token groups and their tails, and several 256-token chunks (merged)
    lens = torch.tensor([1, 15, 16, 17, 100, 200, 257, 700], dtype=torch.int32)
    tables = torch.randperm(num_blocks)[:len(lens) * width].view(len(lens), width).int()
    q = torch.randn(len(lens), heads, head_dim)
    assert cpu_attention.supports(head_dim)
    got = cpu_attention.paged_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    want = reference_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a non-contiguous q (the engine's q is a view of the rotated q|k heads) gives the same
    wide = torch.cat([q, torch.randn(len(lens), 2, head_dim)], dim=1)
    got2 = cpu_attention.paged_decode(wide[:, :heads], k_cache, v_cache, tables, lens, head_dim ** -0.5)
    assert torch.equal(got2, got)


@needs_cc
def test_c_decode_kernel_head_sizes() -> None:
    assert cpu_attention.supports(64)
    assert not cpu_attention.supports(48)  # no such head size built


def test_no_compiler_means_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    build.library.cache_clear()
    try:
        assert build.library() is None
        assert not cpu_attention.supports(64)
    finally:
        build.library.cache_clear()


@needs_cc
@on_x86
def test_kernels_built_without_avx512_keep_working(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A CPU without AVX-512 (the build sees no __AVX512F__): the C matmuls say they are not
    # supported, so the layers keep the library matmuls, and decode attention takes the
    # portable C path, which must still match dense attention.
    with kernels_built_for("avx2", tmp_path):
        lib = build.library()
        assert lib is not None and lib.bg_small_gemm_supported() == 0
        assert not cpu_linear.small_gemm_available() and not cpu_linear.panel_gemm_available()
        torch.manual_seed(0)
        k_cache, v_cache = torch.randn(60, 16, 3, 64), torch.randn(60, 16, 3, 64)
        lens = torch.tensor([1, 17, 300], dtype=torch.int32)
        tables = torch.randperm(60)[:57].view(3, 19).int()
        q = torch.randn(3, 9, 64)
        got = cpu_attention.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
        want = reference_decode(q, k_cache, v_cache, tables, lens, 0.125)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
