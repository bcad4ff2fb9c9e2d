"""The C residual add + RMSNorm, rotation and SiLU * up kernels (`kernels/cpu/ops.py`)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from batchgen_data.kernels.cpu import ops
from batchgen_data.layers.backend import LayerBackend
from batchgen_data.layers.rotary import RotaryEmbedding

from cpu_kernel_utils import needs_fused_ops
from kernel_test_utils import assert_close_sum

pytestmark = pytest.mark.cpu_kind


@needs_fused_ops
@pytest.mark.parametrize("rows", [1, 3, 64, 130])  # 64+: the rows are split over threads
@pytest.mark.parametrize("n", [64, 576, 37])
def test_c_rms_norm_matches_torch(rows: int, n: int) -> None:
    torch.manual_seed(rows + n)
    w = torch.randn(n)
    x, res = torch.randn(rows, n) * 3, torch.randn(rows, n)
    out, new_res = ops.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(new_res, x + res)  # the residual sum is exact
    assert_close_sum(out, F.rms_norm(x + res, (n,), w, 1e-5), k=n)
    assert_close_sum(ops.add_rms_norm(x, None, w, 1e-5), F.rms_norm(x, (n,), w, 1e-5), k=n)
    # q/k norms see [T, H, D] views of a wider tensor
    wide = torch.randn(rows, 3, n + 5)[:, :, :n]
    assert_close_sum(ops.add_rms_norm(wide, None, w, 1e-5), F.rms_norm(wide, (n,), w, 1e-5), k=n)


@needs_fused_ops
def test_c_rotation_is_bitwise_the_torch_rotation() -> None:
    cfg = SimpleNamespace(rope_theta=10000.0, max_position_embeddings=512,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 128})
    rot = RotaryEmbedding(cfg, 64, 512)  # built outside a model: the torch implementation
    torch.manual_seed(0)
    heads, kv_heads, t = 9, 3, 7
    qkv = torch.randn(t, (heads + 2 * kv_heads) * 64)
    pos = torch.tensor([0, 5, 511, 100, 100, 3, 64])
    q = qkv[:, :heads * 64].view(t, heads, 64)
    k = qkv[:, heads * 64:(heads + kv_heads) * 64].view(t, kv_heads, 64)
    q_want, k_want = rot(pos, q.clone(), k.clone())
    v_before = qkv[:, (heads + kv_heads) * 64:].clone()
    ops.rotate_(qkv, heads + kv_heads, 64, pos, rot.cos_sin_cache)
    assert torch.equal(q, q_want) and torch.equal(k, k_want)
    assert torch.equal(qkv[:, (heads + kv_heads) * 64:], v_before)  # v untouched
    with pytest.raises(ValueError, match="beyond"):
        ops.rotate_(qkv, 2, 64, torch.full((t,), 512), rot.cos_sin_cache)


@needs_fused_ops
@pytest.mark.parametrize("rows", [1, 5, 2048])  # 2048 x 1536: split over threads
@pytest.mark.parametrize("inter", [1536, 37, 16, 3])
def test_c_silu_mul_matches_torch(rows: int, inter: int) -> None:
    if rows * inter > 2048 * 64 and inter != 1536:
        pytest.skip("one large case is enough")
    torch.manual_seed(rows + inter)
    gu = torch.randn(rows, 2 * inter) * 8
    gu[0, :3] = torch.tensor([-120.0, 0.0, 95.0])[:min(3, inter)]  # exp under/overflow
    gate, up = gu.chunk(2, dim=-1)
    got = ops.silu_mul(gu)
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, F.silu(gate) * up)  # elementwise: torch's defaults
    assert torch.isfinite(got).all()
    torch.testing.assert_close(ops.silu_mul(gu.view(1, rows, -1)), got.view(1, rows, -1))


def test_without_the_fused_ops_layers_keep_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "available", lambda: False)  # a CPU where they do not build
    assert not LayerBackend.choose(torch.device("cpu"), torch.float32, head_dim=64).c_ops
