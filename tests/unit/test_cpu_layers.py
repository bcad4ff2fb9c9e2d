"""The CPU fast paths of the layers: packed oneDNN linears, fused RMSNorm, joint q/k rotation."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchgen_data.layers import cpu_linear
from batchgen_data.layers.cpu_linear import PackedLinear, pack_model_linears
from batchgen_data.layers.norm import RMSNorm
from batchgen_data.layers.rotary import RotaryEmbedding

needs_packing = pytest.mark.skipif(not cpu_linear._packed_ops_ok(), reason="no oneDNN linear ops")


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 33])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    lin = nn.Linear(96, 160, bias=bias)
    packed = PackedLinear(lin, cpu_linear.pack_weight(lin.weight))
    x = torch.randn(rows, 96)
    torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, rows, 96)  # leading dims are flattened and restored
    assert packed(x3).shape == (2, rows, 160)
    torch.testing.assert_close(packed(x3), F.linear(x3, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 24)
        self.inner = nn.Sequential(nn.Linear(24, 16, bias=False))
        self.lm_head = None


@needs_packing
def test_pack_model_swaps_every_linear_and_packs_a_tied_head(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHGEN_CPU_PACKED_LINEAR", raising=False)
    model = _Tied()
    weight = model.proj.weight
    assert pack_model_linears(model, torch.device("cpu"), torch.float32) == 3
    assert isinstance(model.proj, PackedLinear) and isinstance(model.inner[0], PackedLinear)
    assert model.proj.weight is weight  # the plain weight stays readable
    h = torch.randn(5, 16)
    torch.testing.assert_close(cpu_linear.packed_linear(h, model.packed_lm_head, None),
                               F.linear(h, model.embed_tokens.weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_packing_can_be_turned_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("BATCHGEN_CPU_PACKED_LINEAR", value)
    model = _Tied()
    assert pack_model_linears(model, torch.device("cpu"), torch.float32) == 0
    assert type(model.proj) is nn.Linear and not hasattr(model, "packed_lm_head")


def test_packing_env_value_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHGEN_CPU_PACKED_LINEAR", "maybe")
    with pytest.raises(ValueError, match="BATCHGEN_CPU_PACKED_LINEAR"):
        pack_model_linears(_Tied(), torch.device("cpu"), torch.float32)


def test_packing_skips_other_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHGEN_CPU_PACKED_LINEAR", raising=False)
    model = _Tied().half()
    assert pack_model_linears(model, torch.device("cpu"), torch.float16) == 0
    assert type(model.proj) is nn.Linear


@pytest.mark.parametrize("rows", [1, 8])
def test_fused_rms_norm_is_bitwise_the_reference(rows: int) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    x, res = torch.randn(rows, 64), torch.randn(rows, 64)
    h = x + res
    want = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    out, new_res = norm(x, res)
    assert torch.equal(out, want) and torch.equal(new_res, h)


def test_joint_qk_rotation_equals_separate() -> None:
    cfg = SimpleNamespace(rope_theta=10000.0, max_position_embeddings=64)
    rot = RotaryEmbedding(cfg, 16, 64)
    torch.manual_seed(0)
    q, k = torch.randn(5, 6, 16), torch.randn(5, 2, 16)
    pos = torch.tensor([0, 3, 7, 8, 63])
    q_want, k_want = rot(pos, q, k)
    both = rot.rotate(pos, torch.cat([q, k], dim=1))
    assert torch.equal(both[:, :6], q_want) and torch.equal(both[:, 6:], k_want)
    # the cos/sin memo follows the positions tensor, not a stale one
    pos2 = torch.tensor([1, 1, 1, 1, 1])
    q2, _ = rot(pos2, q, k)
    assert not torch.equal(q2, q_want)
