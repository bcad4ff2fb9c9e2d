"""The CPU fast paths of the layers: packed oneDNN linears, fused RMSNorm, joint q/k rotation."""
from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchgen_data import env
from batchgen_data.layers import cpu_linear, cpu_ops
from batchgen_data.layers.cpu_linear import PackedLinear, pack_model_linears
from batchgen_data.layers.norm import RMSNorm
from batchgen_data.layers.rotary import RotaryEmbedding

@pytest.fixture
def fused_ops(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Sets BATCHGEN_CPU_FUSED_OPS (None: unset) and drops cpu_ops' cached reading of it."""
    def set_(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("BATCHGEN_CPU_FUSED_OPS", raising=False)
        else:
            monkeypatch.setenv("BATCHGEN_CPU_FUSED_OPS", value)
        cpu_ops.refresh()
    yield set_
    cpu_ops.refresh()  # lazily re-read once monkeypatch has restored the environment


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
def test_fused_rms_norm_is_bitwise_the_reference(rows: int, fused_ops) -> None:  # type: ignore[no-untyped-def]
    fused_ops("0")  # the torch path (the C one: below)
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


# ---- the compiled C decode-attention kernel ------------------------------------------------
from batchgen_data.layers import cpu_attention, cpu_kernels  # noqa: E402

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                              reason="no C compiler")


def _reference_decode(q, k_cache, v_cache, tables, lens, scale):  # type: ignore[no-untyped-def]
    outs = []
    bs = k_cache.shape[1]
    for i, n in enumerate(lens.tolist()):
        blocks = tables[i, :-(-n // bs)].long()
        k = k_cache[blocks].flatten(0, 1)[:n]  # [n, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[:n]
        o = F.scaled_dot_product_attention(q[i][:, None], k.transpose(0, 1), v.transpose(0, 1),
                                           scale=scale, enable_gqa=True)
        outs.append(o[:, 0])
    return torch.stack(outs)


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
    assert cpu_attention.available(k_cache)
    got = cpu_attention.paged_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    want = _reference_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a non-contiguous q (the engine's q is a view of the rotated q|k heads) gives the same
    wide = torch.cat([q, torch.randn(len(lens), 2, head_dim)], dim=1)
    got2 = cpu_attention.paged_decode(wide[:, :heads], k_cache, v_cache, tables, lens, head_dim ** -0.5)
    assert torch.equal(got2, got)


@needs_cc
def test_c_decode_kernel_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHGEN_CPU_ATTENTION_KERNEL", raising=False)
    assert cpu_attention.available(torch.zeros(2, 16, 2, 64))
    assert not cpu_attention.available(torch.zeros(2, 16, 2, 48))  # no such head size built
    assert not cpu_attention.available(torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16))
    monkeypatch.setenv("BATCHGEN_CPU_ATTENTION_KERNEL", "0")
    assert not cpu_attention.available(torch.zeros(2, 16, 2, 64))


def test_no_compiler_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    cpu_kernels.library.cache_clear()
    try:
        assert not cpu_attention.available(torch.zeros(2, 16, 2, 64))
    finally:
        cpu_kernels.library.cache_clear()


@needs_packing
def test_big_models_drop_the_plain_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHGEN_CPU_PACKED_LINEAR", raising=False)
    model = _Tied()
    ref = {n: F.linear(torch.ones(2, m.in_features), m.weight, m.bias)
           for n, m in (("proj", model.proj), ("inner", model.inner[0]))}
    assert pack_model_linears(model, torch.device("cpu"), torch.float32, plain_copy_budget=100) == 2
    assert model.proj.weight is None and not hasattr(model, "packed_lm_head")
    torch.testing.assert_close(model.proj(torch.ones(2, 16)), ref["proj"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.inner[0](torch.ones(2, 24)), ref["inner"], rtol=1e-5, atol=1e-5)


# ---- the compiled C small-row matmul -------------------------------------------------------
needs_small_gemm = pytest.mark.skipif(not cpu_linear.small_gemm_available(),
                                      reason="no C compiler or no AVX-512 here")


@needs_small_gemm
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16])
@pytest.mark.parametrize("shape", [(160, 96), (37, 53), (6, 16), (5, 15), (576, 1536)])
def test_small_linear_matches_f_linear(rows: int, bias: bool, shape: tuple[int, int]) -> None:
    # weight-row tails (N % 6), masked K tails (K % 16), a single weight block, K below 16
    torch.manual_seed(rows)
    out_f, in_f = shape
    tol = 1e-4 * max(1.0, in_f / 256)  # sums of in_f products of N(0, 1) values
    weight = torch.randn(out_f, in_f)
    b = torch.randn(out_f) if bias else None
    x = torch.randn(rows, in_f)
    torch.testing.assert_close(cpu_linear.small_linear(x, weight, b), F.linear(x, weight, b),
                               rtol=1e-5, atol=tol)
    x3 = torch.randn(2, rows, in_f)[:, :, :]  # leading dims flattened and restored
    torch.testing.assert_close(cpu_linear.small_linear(x3, weight, b), F.linear(x3, weight, b),
                               rtol=1e-5, atol=tol)
    xt = torch.randn(in_f, rows).t()  # a non-contiguous input is copied first
    torch.testing.assert_close(cpu_linear.small_linear(xt, weight, b), F.linear(xt, weight, b),
                               rtol=1e-5, atol=tol)


@needs_small_gemm
def test_small_linear_rejects_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="small_linear"):
        cpu_linear.small_linear(torch.randn(2, 8), torch.randn(16, 4).t(), None)  # strided W
    with pytest.raises(ValueError, match="small_linear"):
        cpu_linear.small_linear(torch.randn(2, 8), torch.randn(4, 9), None)  # K mismatch


@needs_small_gemm
@needs_packing
def test_packed_layers_route_few_rows_to_the_small_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHGEN_CPU_PACKED_LINEAR", raising=False)
    monkeypatch.delenv("BATCHGEN_CPU_SMALL_GEMM", raising=False)
    calls: list[int] = []
    panel_calls: list[int] = []
    real, real_panel = cpu_linear.small_linear, cpu_linear.panel_linear

    def spy(x, weight, bias):  # type: ignore[no-untyped-def]
        calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, weight, bias)

    def panel_spy(x, panels, bias, out_features):  # type: ignore[no-untyped-def]
        panel_calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real_panel(x, panels, bias, out_features)

    monkeypatch.setattr(cpu_linear, "small_linear", spy)
    monkeypatch.setattr(cpu_linear, "panel_linear", panel_spy)
    model = _Tied()
    pack_model_linears(model, torch.device("cpu"), torch.float32)
    assert model.proj.small_gemm and model.lm_head_small_gemm
    has_panels = cpu_linear.panel_gemm_available()
    assert (model.proj.panel_weight is not None) == has_panels
    assert (model.panel_lm_head is not None) == has_panels
    small, panel = cpu_linear.SMALL_GEMM_MAX_ROWS, cpu_linear.PANEL_MAX_ROWS
    for rows in (1, small, small + 1, panel, panel + 1, 100):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(model.proj(x), F.linear(x, model.proj.weight, model.proj.bias),
                                   rtol=1e-5, atol=1e-5)
    assert calls == [1, small]
    # the panel kernel takes the middle; more rows go to oneDNN
    assert panel_calls == ([small + 1, panel] if has_panels else [])
    # switched off: the layers never call it
    monkeypatch.setenv("BATCHGEN_CPU_SMALL_GEMM", "0")
    model = _Tied()
    pack_model_linears(model, torch.device("cpu"), torch.float32)
    assert not model.proj.small_gemm and not model.lm_head_small_gemm
    calls.clear()
    model.proj(torch.randn(4, 16))
    assert calls == []


def test_small_kernel_needs_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    cpu_kernels.library.cache_clear()
    cpu_linear._small_gemm_checked.cache_clear()
    try:
        assert not cpu_linear.small_gemm_available()
    finally:
        cpu_kernels.library.cache_clear()
        cpu_linear._small_gemm_checked.cache_clear()


@needs_cc
@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="x86-64 flags")
def test_kernels_built_without_avx512_keep_working(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A CPU without AVX-512 (the build sees no __AVX512F__): the small-row matmul says it is not
    # supported, so the layers keep the library matmuls, and decode attention takes the
    # portable C path, which must still match dense attention.
    monkeypatch.setenv(env.CACHE_DIR_VAR, str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "FLAGS", [f if f != "-march=native" else "-march=x86-64-v3"
                                               for f in cpu_kernels.FLAGS])
    cpu_kernels.library.cache_clear()
    cpu_linear._small_gemm_checked.cache_clear()
    try:
        lib = cpu_kernels.library()
        assert lib is not None and lib.bg_small_gemm_supported() == 0
        assert not cpu_linear.small_gemm_available()
        torch.manual_seed(0)
        k_cache, v_cache = torch.randn(60, 16, 3, 64), torch.randn(60, 16, 3, 64)
        lens = torch.tensor([1, 17, 300], dtype=torch.int32)
        tables = torch.randperm(60)[:57].view(3, 19).int()
        q = torch.randn(3, 9, 64)
        got = cpu_attention.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
        want = _reference_decode(q, k_cache, v_cache, tables, lens, 0.125)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        cpu_kernels.library.cache_clear()
        cpu_linear._small_gemm_checked.cache_clear()


# ---- the C residual add + RMSNorm and rotary kernels --------------------------------------
needs_fused_ops = pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")


@needs_fused_ops
@pytest.mark.parametrize("rows", [1, 3, 64, 130])  # 64+: the rows are split over threads
@pytest.mark.parametrize("n", [64, 576, 37])
def test_c_rms_norm_matches_torch(rows: int, n: int, fused_ops) -> None:  # type: ignore[no-untyped-def]
    fused_ops(None)
    torch.manual_seed(rows + n)
    norm = RMSNorm(n, 1e-5)
    norm.weight.data = torch.randn(n)
    x, res = torch.randn(rows, n) * 3, torch.randn(rows, n)
    out, new_res = norm(x, res)
    assert torch.equal(new_res, x + res)  # the residual sum is exact
    want = F.rms_norm(x + res, (n,), norm.weight, 1e-5)
    torch.testing.assert_close(out, want, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (n,), norm.weight, 1e-5), rtol=2e-6, atol=2e-6)
    # q/k norms see [T, H, D] views of a wider tensor
    wide = torch.randn(rows, 3, n + 5)[:, :, :n]
    torch.testing.assert_close(norm(wide), F.rms_norm(wide, (n,), norm.weight, 1e-5),
                               rtol=2e-6, atol=2e-6)


@needs_fused_ops
def test_c_rotation_is_bitwise_the_torch_path(fused_ops) -> None:  # type: ignore[no-untyped-def]
    fused_ops(None)
    cfg = SimpleNamespace(rope_theta=10000.0, max_position_embeddings=512,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 128})
    rot = RotaryEmbedding(cfg, 64, 512)
    torch.manual_seed(0)
    heads, kv_heads, t = 9, 3, 7
    qkv = torch.randn(t, (heads + 2 * kv_heads) * 64)
    pos = torch.tensor([0, 5, 511, 100, 100, 3, 64])
    want = rot.rotate(pos, qkv[:, :(heads + kv_heads) * 64].view(t, heads + kv_heads, 64))
    v_before = qkv[:, (heads + kv_heads) * 64:].clone()
    cpu_ops.rotate_(qkv, heads + kv_heads, 64, pos, rot.cos_sin_cache)
    assert torch.equal(qkv[:, :(heads + kv_heads) * 64].view(t, heads + kv_heads, 64), want)
    assert torch.equal(qkv[:, (heads + kv_heads) * 64:], v_before)  # v untouched
    with pytest.raises(ValueError, match="beyond"):
        cpu_ops.rotate_(qkv, 2, 64, torch.full((t,), 512), rot.cos_sin_cache)


@needs_fused_ops
@pytest.mark.parametrize("rows", [1, 5, 2048])  # 2048 x 1536: split over threads
@pytest.mark.parametrize("inter", [1536, 37, 16, 3])
def test_c_silu_mul_matches_torch(rows: int, inter: int, fused_ops) -> None:  # type: ignore[no-untyped-def]
    fused_ops(None)
    if rows * inter > 2048 * 64 and inter != 1536:
        pytest.skip("one large case is enough")
    torch.manual_seed(rows + inter)
    gu = torch.randn(rows, 2 * inter) * 8
    gu[0, :3] = torch.tensor([-120.0, 0.0, 95.0])[:min(3, inter)]  # exp under/overflow
    gate, up = gu.chunk(2, dim=-1)
    got = cpu_ops.silu_mul(gu)
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=2e-6, atol=1e-6)
    assert torch.isfinite(got).all()
    # the MLP takes this path for fp32 CPU activations; leading dims are kept
    torch.testing.assert_close(cpu_ops.silu_mul(gu.view(1, rows, -1)), got.view(1, rows, -1))


def test_fused_ops_can_be_turned_off(fused_ops) -> None:  # type: ignore[no-untyped-def]
    fused_ops("off")
    assert not cpu_ops.usable(torch.zeros(1))
    fused_ops(None)
    assert not cpu_ops.usable(torch.zeros(1, dtype=torch.bfloat16))


@needs_small_gemm
@pytest.mark.skipif(not cpu_linear.panel_gemm_available(), reason="no C compiler or no AVX-512")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 17, 64])
@pytest.mark.parametrize("shape", [(160, 96), (53, 37), (48, 16), (5, 3), (576, 1536)])
def test_panel_linear_matches_f_linear(rows: int, bias: bool, shape: tuple[int, int]) -> None:
    # partial last panels (N % 48), a single panel, K below 16, row tiles of 8 and their tails
    torch.manual_seed(rows)
    out_f, in_f = shape
    tol = 1e-4 * max(1.0, in_f / 256)  # sums of in_f products of N(0, 1) values
    weight = torch.randn(out_f, in_f)
    b = torch.randn(out_f) if bias else None
    panels = cpu_linear.pack_panels(weight)
    assert panels.numel() == -(-out_f // 48) * 48 * in_f
    x = torch.randn(rows, in_f)
    torch.testing.assert_close(cpu_linear.panel_linear(x, panels, b, out_f), F.linear(x, weight, b),
                               rtol=1e-5, atol=tol)
    xt = torch.randn(in_f, rows).t()  # a non-contiguous input is copied first
    torch.testing.assert_close(cpu_linear.panel_linear(xt, panels, b, out_f),
                               F.linear(xt, weight, b), rtol=1e-5, atol=tol)
    with pytest.raises(ValueError, match="panel_linear"):
        cpu_linear.panel_linear(torch.randn(rows, in_f + 1), panels, b, out_f)


@needs_packing
def test_panel_copies_need_twice_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHGEN_CPU_PACKED_LINEAR", raising=False)
    model = _Tied()
    copy_bytes = 4 * (16 * 24 + 24 * 16 + 50 * 16)  # proj, inner, tied embedding
    pack_model_linears(model, torch.device("cpu"), torch.float32, plain_copy_budget=copy_bytes)
    assert model.proj.weight is not None and model.proj.panel_weight is None  # plain kept only
    assert model.panel_lm_head is None
