"""write_kv_cache launcher vs. the torch reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchgen_data.kernels import reference, write_kv_cache  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size, kv_heads, head_dim", [(16, 2, 32), (32, 3, 24)])
def test_matches_reference(block_size: int, kv_heads: int, head_dim: int,
                           dtype: torch.dtype) -> None:
    num_blocks, tokens = 6, 9
    k = torch.randn(tokens, kv_heads, head_dim).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[[2, 5]] = -1  # padding tokens
    exp_k, exp_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(k, v, exp_k, exp_v, slots)
    before = k_cache.clone()
    write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, exp_k) and torch.equal(v_cache, exp_v)
    flat = k_cache.view(-1, kv_heads, head_dim)
    assert torch.equal(flat[slots[0]], k[0])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(flat[untouched], before.view(-1, kv_heads, head_dim)[untouched])


def test_views_into_fused_qkv() -> None:
    qkv = torch.randn(4, 3, 2, 16)  # [T, q|k|v, Hkv, D]
    k, v = qkv[:, 1], qkv[:, 2]  # token stride 96, head stride 16
    k_cache = torch.zeros(2, 16, 2, 16)
    v_cache = torch.zeros(2, 16, 2, 16)
    slots = torch.tensor([0, 17, 31, 5])
    write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 16)[slots], k)
    assert torch.equal(v_cache.view(-1, 2, 16)[slots], v)


def _args(**override):
    args = dict(
        k=torch.randn(3, 2, 16), v=torch.randn(3, 2, 16), k_cache=torch.zeros(2, 16, 2, 16),
        v_cache=torch.zeros(2, 16, 2, 16), slot_mapping=torch.arange(3),
    )
    args.update(override)
    return args


@pytest.mark.parametrize(
    "override, match",
    [
        ({"slot_mapping": torch.arange(3).int()}, "slot_mapping dtype"),
        ({"v": torch.randn(3, 2, 16).half()}, "v dtype"),
        ({"k_cache": torch.zeros(2, 16, 4, 16)}, "v_cache must have shape"),
        ({"k_cache": torch.zeros(2, 16, 4, 16), "v_cache": torch.zeros(2, 16, 4, 16)},
         "do not match"),
        ({"k_cache": torch.zeros(16, 2, 2, 16).transpose(0, 1)}, "contiguous"),
        ({"slot_mapping": torch.arange(4)}, "slot_mapping must have shape"),
    ],
)
def test_validation(override: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        write_kv_cache(**_args(**override))
