"""The FP8 KV cache in the Triton kernels (under TRITON_INTERPRET=1, fp32/fp16): the write
kernel's rounding is torch's e4m3 cast bit for bit, and paged decode / prefill attention over
e4m3 codes with per-tensor scales match an independent oracle (dequantize, then SDPA)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from batchgen_data.kernels import (  # noqa: E402
    paged_decode_attention,
    paged_prefill_attention,
    reference,
    write_kv_cache,
)
from kernel_test_utils import shuffled_block_tables  # noqa: E402

FP8 = torch.float8_e4m3fn
KV_HEADS = 2


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _all_codes_and_midpoints() -> torch.Tensor:
    pos = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # 0 .. 448
    mids = (pos[:-1] + pos[1:]) / 2  # every tie
    return torch.cat([pos, -pos, mids, -mids, torch.tensor([449.0, 470.0, 1e4, -1e4, 1e-12])])


@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.37, 2.5)])
def test_write_rounds_like_torch(k_scale: float, v_scale: float) -> None:
    vals = _all_codes_and_midpoints()
    extra = torch.cat([torch.randn(3000) * 40, torch.randn(3000) * 0.01])
    x = torch.cat([vals, extra]) * k_scale  # ties land on ties after the scale (mostly)
    d = 16
    n = -(-x.numel() // (KV_HEADS * d))
    x = torch.cat([x, torch.zeros(n * KV_HEADS * d - x.numel())]).view(n, KV_HEADS, d)
    k, v = x, x * (v_scale / k_scale)
    kc = torch.zeros(n, 1, KV_HEADS, d, dtype=FP8)  # block_size 1: slot t = block t
    vc = torch.zeros_like(kc)
    slots = torch.randperm(n)
    write_kv_cache(k, v, kc, vc, slots, k_scale, v_scale)
    rk, rv = torch.zeros_like(kc), torch.zeros_like(vc)
    reference.write_kv_cache(k, v, rk, rv, slots, k_scale, v_scale)
    assert torch.equal(kc.view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rv.view(torch.uint8))


def test_write_from_fp16() -> None:
    k = (torch.randn(9, KV_HEADS, 32) * 3).half()
    v = torch.randn(9, KV_HEADS, 32).half()
    kc = torch.zeros(3, 4, KV_HEADS, 32, dtype=FP8)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([0, 1, 2, 3, 4, 5, 9, 10, -1])
    write_kv_cache(k, v, kc, vc, slots, 0.5, 1.0)
    rk, rv = torch.zeros_like(kc), torch.zeros_like(vc)
    reference.write_kv_cache(k, v, rk, rv, slots, 0.5, 1.0)
    assert torch.equal(kc.view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rv.view(torch.uint8))


def _fp8_cache(seq_lens: list[int], block_size: int, head_dim: int):
    tables, num_blocks = shuffled_block_tables(seq_lens, block_size, spare=2)
    shape = (num_blocks, block_size, KV_HEADS, head_dim)
    # codes over the whole e4m3 range (subnormals included), never NaN
    k = (torch.randn(shape) * 60).clamp(-448, 448).to(FP8)
    v = (torch.randn(shape) * 0.05).to(FP8)
    return k, v, tables, torch.tensor(seq_lens, dtype=torch.int32)


def _oracle(q: torch.Tensor, k_cache, v_cache, table: torch.Tensor, length: int,
            scale: float, ks: float, vs: float) -> torch.Tensor:
    """q [Q, H, D], the last Q of `length` tokens: dequantize the sequence's K/V, then SDPA."""
    bs = k_cache.shape[1]
    pos = torch.arange(length)
    slots = table.long()[pos // bs] * bs + pos % bs
    k = k_cache.view(-1, *k_cache.shape[2:])[slots].float() * ks  # [S, Hkv, D]
    v = v_cache.view(-1, *v_cache.shape[2:])[slots].float() * vs
    qt, kt, vt = (t.float().transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    ql = q.shape[0]
    mask = torch.arange(length)[None, :] <= torch.arange(length - ql, length)[:, None]
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("dtype, group, splits, block_size", [
    (torch.float32, 2, 1, 16), (torch.float32, 3, 3, 8), (torch.float16, 2, 2, 16)])
def test_decode_over_fp8_matches_dequantize_then_sdpa(dtype: torch.dtype, group: int,
                                                      splits: int, block_size: int) -> None:
    lens = [1, 23, 70]
    kc, vc, tables, seq_lens = _fp8_cache(lens, block_size, 32)
    q = torch.randn(len(lens), KV_HEADS * group, 32).to(dtype) * 0.05
    ks, vs, scale = 0.25, 3.0, 32 ** -0.5
    out = paged_decode_attention(q, kc, vc, tables, seq_lens, scale, num_splits=splits,
                                 k_scale=ks, v_scale=vs)
    assert out.dtype == dtype
    want = torch.cat([_oracle(q[i:i + 1], kc, vc, tables[i], n, scale, ks, vs)
                      for i, n in enumerate(lens)])
    _close(out, want, dtype)
    ref = reference.paged_decode_attention(q, kc, vc, tables, seq_lens, scale, k_scale=ks,
                                           v_scale=vs)
    _close(ref, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_over_fp8_matches_dequantize_then_sdpa(dtype: torch.dtype) -> None:
    lens, q_lens = [9, 40, 17], [9, 13, 1]  # no prefix, a cached prefix, one token
    kc, vc, tables, seq_lens = _fp8_cache(lens, 8, 32)
    cu = torch.tensor([0, 9, 22, 23], dtype=torch.int32)
    q = torch.randn(23, KV_HEADS * 2, 32).to(dtype) * 0.05
    ks, vs, scale = 0.5, 2.0, 32 ** -0.5
    out = paged_prefill_attention(q, kc, vc, tables, cu, seq_lens, scale, max_seqlen_q=13,
                                  k_scale=ks, v_scale=vs)
    want = torch.cat([_oracle(q[cu[i]:cu[i + 1]], kc, vc, tables[i], n, scale, ks, vs)
                      for i, n in enumerate(lens)])
    _close(out, want, dtype)


def test_fp8_cache_needs_positive_scales() -> None:
    kc, vc, tables, seq_lens = _fp8_cache([5], 8, 32)
    q = torch.randn(1, 4, 32)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention(q, kc, vc, tables, seq_lens, 0.1, k_scale=0.0)
    with pytest.raises(ValueError, match="v_scale"):
        write_kv_cache(q[:, :2], q[:, :2], kc, vc, torch.tensor([0]), 1.0, float("nan"))
    with pytest.raises(ValueError, match="v_cache dtype"):  # an FP8 K plane needs an FP8 V one
        paged_decode_attention(q, kc, vc.float(), tables, seq_lens, 0.1)


def test_selfcheck_fp8_cases() -> None:
    """The GPU self-check's FP8 KV cases (`selfcheck --quant`) compute what they claim."""
    from batchgen_data.kernels import selfcheck

    cpu = torch.device("cpu")
    assert selfcheck.case_fp8_kv_write(torch.float32, cpu) == 0.0
    assert selfcheck.case_fp8_kv_attention(torch.float32, False, 64, cpu) < 1e-4
    names = [name for name, _, _ in selfcheck.quant_cases()]
    assert "fp8 kv write (codes differing)" in names and "fp8 kv prefill D=128" in names
