"""The C decode-attention kernel over an FP8 KV cache (`bg_paged_decode_fp8`) against an
independent oracle: the codes dequantized with their per-tensor scales, then dense attention.
The AVX-512 build and the portable one (what a CPU without AVX-512 runs) both."""
from __future__ import annotations

import pytest
import torch

from batchgen_data.kernels.cpu import attention as cpu_attention
from batchgen_data.kernels.cpu import build

from cpu_kernel_utils import kernels_built_for, needs_cc, on_x86, reference_decode

pytestmark = pytest.mark.cpu_kind

FP8 = torch.float8_e4m3fn


def _case(head_dim: int, heads: int, kv_heads: int, bs: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(head_dim + bs)
    width = -(-300 // bs)
    num_blocks = 5 * width
    # codes over the whole e4m3 range, subnormals included (|x| < 2^-6)
    k = (torch.randn(num_blocks, bs, kv_heads, head_dim) * 40).clamp(-448, 448).to(FP8)
    v = (torch.randn(num_blocks, bs, kv_heads, head_dim) * 0.03).to(FP8)
    lens = torch.tensor([1, 16, 17, 257, 300], dtype=torch.int32)
    tables = torch.randperm(num_blocks)[:len(lens) * width].view(len(lens), width).int()
    q = torch.randn(len(lens), heads, head_dim) * 0.02
    return q, k, v, tables, lens


def _check(head_dim: int, heads: int, kv_heads: int, bs: int) -> None:
    q, k, v, tables, lens = _case(head_dim, heads, kv_heads, bs)
    ks, vs, scale = 0.375, 2.5, head_dim ** -0.5
    got = cpu_attention.paged_decode(q, k, v, tables, lens, scale, ks, vs)
    want = reference_decode(q, k.float() * ks, v.float() * vs, tables, lens, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_cc
@pytest.mark.parametrize("head_dim, heads, kv_heads, bs", [
    (16, 4, 2, 16), (32, 4, 4, 8), (64, 9, 3, 16), (128, 8, 1, 32), (256, 2, 1, 16)])
def test_fp8_decode_matches_dequantize_then_attention(head_dim: int, heads: int,
                                                      kv_heads: int, bs: int) -> None:
    assert cpu_attention.supports(head_dim)
    _check(head_dim, heads, kv_heads, bs)


@needs_cc
def test_fp8_decode_refuses_mixed_caches() -> None:
    q, k, v, tables, lens = _case(32, 4, 2, 16)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        cpu_attention.paged_decode(q, k, v.float(), tables, lens, 0.1)


@needs_cc
@on_x86
def test_fp8_decode_portable_build(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with kernels_built_for("avx2", tmp_path):
        assert build.library() is not None
        _check(64, 6, 2, 16)
        _check(32, 4, 4, 8)
