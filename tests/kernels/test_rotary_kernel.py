"""apply_rotary launcher vs. the torch reference, including views into a fused qkv tensor."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchgen_data.kernels import apply_rotary, reference  # noqa: E402
from kernel_test_utils import assert_close  # noqa: E402


def _cos_sin_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)  # [max_pos, rot_dim]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, rot_dim", [(4, 4, 32, 32), (6, 2, 64, 32)])
def test_matches_reference(heads: int, kv_heads: int, head_dim: int, rot_dim: int,
                           dtype: torch.dtype) -> None:
    tokens = 7
    q = torch.randn(tokens, heads, head_dim).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim).to(dtype)
    positions = torch.tensor([0, 1, 5, 17, 63, 2, 40])
    cache = _cos_sin_cache(64, rot_dim)
    exp_q, exp_k = reference.apply_rotary(q.clone(), k.clone(), positions, cache)
    q_in, k_in = q.clone(), k.clone()
    out_q, out_k = apply_rotary(q_in, k_in, positions, cache)
    assert out_q is q_in and out_k is k_in
    assert_close(q_in, exp_q)
    assert_close(k_in, exp_k)
    assert torch.equal(q_in[0], q[0])  # position 0 is the identity rotation
    assert not torch.allclose(q_in[1:, :, :rot_dim], q[1:, :, :rot_dim])
    assert torch.equal(q_in[..., rot_dim:], q[..., rot_dim:])  # partial rotary leaves the tail


def test_reference_is_rotate_half() -> None:
    # Llama's formulation: x * cos + rotate_half(x) * sin with cos/sin repeated over both halves.
    q = torch.randn(3, 2, 16)
    k = torch.randn(3, 1, 16)
    positions = torch.tensor([3, 9, 1])
    cache = _cos_sin_cache(16, 16)
    cos = cache[positions, :8].repeat(1, 2)[:, None, :]
    sin = cache[positions, 8:].repeat(1, 2)[:, None, :]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-x[..., 8:], x[..., :8]], dim=-1)

    expected_q = q * cos + rotate_half(q) * sin
    out_q, _ = reference.apply_rotary(q.clone(), k.clone(), positions, cache)
    torch.testing.assert_close(out_q, expected_q)


def test_views_into_fused_qkv() -> None:
    heads, kv_heads, head_dim = 4, 2, 32
    qkv = torch.randn(5, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, : heads * head_dim].view(5, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(5, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.arange(5) * 3
    cache = _cos_sin_cache(16, head_dim)
    exp_q, exp_k = reference.apply_rotary(q.clone(), k.clone(), positions, cache)
    apply_rotary(q, k, positions, cache)
    assert_close(q, exp_q)
    assert_close(k, exp_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)


@pytest.mark.parametrize(
    "q, k, positions, cache, match",
    [
        (torch.randn(3, 2, 16), torch.randn(3, 1, 16), torch.arange(3).int(),
         torch.randn(8, 16), "positions dtype"),
        (torch.randn(3, 2, 16), torch.randn(3, 1, 16), torch.arange(3),
         torch.randn(8, 15), "even"),
        (torch.randn(3, 2, 16), torch.randn(3, 1, 8), torch.arange(3),
         torch.randn(8, 8), "does not match"),
        (torch.randn(3, 2, 16), torch.randn(3, 1, 16).half(), torch.arange(3),
         torch.randn(8, 16), "k dtype"),
    ],
)
def test_validation(q, k, positions, cache, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        apply_rotary(q, k, positions, cache)
