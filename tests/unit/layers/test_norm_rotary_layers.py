"""RMSNorm, the rotary embedding and SiLU * up: the torch implementation against the HF
formulas, and the C one (when built) against torch."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from batchgen_data.kernels.cpu import ops
from batchgen_data.layers.activation import SiluAndMul
from batchgen_data.layers.backend import LayerBackend, building
from batchgen_data.layers.norm import RMSNorm
from batchgen_data.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.cpu_kind

needs_c = pytest.mark.skipif(not ops.available(), reason="no C compiler")
C_OPS = LayerBackend(torch.device("cpu"), torch.float32, c_ops=True)
CFG = SimpleNamespace(rope_theta=10000.0, max_position_embeddings=64)


@pytest.mark.parametrize("rows", [1, 8])
def test_torch_rms_norm_is_bitwise_the_reference(rows: int) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    x, res = torch.randn(rows, 64), torch.randn(rows, 64)
    h = x + res
    want = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    out, new_res = norm(x, res)
    assert torch.equal(out, want) and torch.equal(new_res, h)


@needs_c
def test_c_rms_norm_layer_matches_torch() -> None:
    with building(C_OPS):
        norm = RMSNorm(37, 1e-5)
    norm.weight.data = torch.randn(37)
    x, res = torch.randn(6, 37), torch.randn(6, 37)
    out, new_res = norm(x, res)
    assert torch.equal(new_res, x + res)
    # a sum of 37 squares in another order: about 4 * eps * 37 of the row's size
    torch.testing.assert_close(out, F.rms_norm(x + res, (37,), norm.weight, 1e-5),
                               rtol=1.3e-6, atol=4 * torch.finfo(torch.float32).eps * 37 * 4)


def _qkv_views(t: int, heads: int, kv_heads: int, d: int):  # type: ignore[no-untyped-def]
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return qkv, q.view(t, heads, d), k.view(t, kv_heads, d)


def test_joint_qk_rotation_equals_separate() -> None:
    rot = RotaryEmbedding(CFG, 16, 64)
    torch.manual_seed(0)
    pos = torch.tensor([0, 3, 7, 8, 63])
    _, q, k = _qkv_views(5, 6, 2, 16)  # adjacent views: rotated in one pass
    q_joint, k_joint = rot(pos, q, k)
    q_sep, k_sep = rot(pos, q.clone(), k.clone())  # separate tensors: one pass each
    assert torch.equal(q_joint, q_sep) and torch.equal(k_joint, k_sep)
    assert not torch.equal(q_joint, q)  # the torch path returns new tensors
    # the cos/sin memo follows the positions tensor, not a stale one
    q2, _ = rot(torch.ones(5, dtype=torch.long), q, k)
    assert not torch.equal(q2, q_joint)


@needs_c
@pytest.mark.parametrize("adjacent", [True, False])
def test_c_rotation_in_place_is_bitwise_torch(adjacent: bool) -> None:
    torch_rot = RotaryEmbedding(CFG, 16, 64)
    with building(C_OPS):
        c_rot = RotaryEmbedding(CFG, 16, 64)
    torch.manual_seed(1)
    pos = torch.tensor([0, 3, 7, 8, 63])
    qkv, q, k = _qkv_views(5, 6, 2, 16)
    if not adjacent:  # e.g. Qwen3: q and k come out of their norms as separate tensors
        q, k = q.clone(), k.clone()
    v_before = qkv[:, 8 * 16:].clone()
    want_q, want_k = torch_rot(pos, q, k)
    got_q, got_k = c_rot(pos, q, k)
    assert got_q is q and got_k is k  # rotated in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, 8 * 16:], v_before)


def test_silu_and_mul_torch_and_c() -> None:
    gu = torch.randn(5, 2 * 37) * 6
    gate, up = gu.chunk(2, dim=-1)
    assert torch.equal(SiluAndMul()(gu), F.silu(gate) * up)
    if ops.available():
        with building(C_OPS):
            act = SiluAndMul()
        torch.testing.assert_close(act(gu), F.silu(gate) * up)  # elementwise: torch's defaults
