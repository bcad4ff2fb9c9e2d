"""Linear layers and the token embedding keep one copy of each weight, in the layout their
backend's kernels read, and compute F.linear / the embedding lookup on it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen_data.kernels.cpu import linear as cpu_linear
from batchgen_data.layers.backend import LayerBackend, building
from batchgen_data.layers.embedding import VocabEmbedding
from batchgen_data.layers.linear import Linear, MergedLinear, QKVLinear

pytestmark = pytest.mark.cpu_kind

CPU = torch.device("cpu")
LAYOUTS = [
    "plain",
    pytest.param("onednn", marks=pytest.mark.skipif(not cpu_linear.onednn_available(),
                                                    reason="no oneDNN linear ops")),
    pytest.param("panels", marks=pytest.mark.skipif(not cpu_linear.panel_gemm_available(),
                                                    reason="no C compiler or no AVX-512")),
    pytest.param("rows", marks=pytest.mark.skipif(not cpu_linear.rows_gemm_available(),
                                                  reason="no C compiler or no AVX2/FMA")),
]
PLAIN_WEIGHT = ("plain", "rows")  # the layouts that keep the [out, in] weight itself


def _built(layout: str, make):  # type: ignore[no-untyped-def]
    with building(LayerBackend(CPU, torch.float32, linear=layout)):
        return make()


def _fill(module: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_keeps_one_copy_and_matches_f_linear(layout: str, bias: bool) -> None:
    lin = _built(layout, lambda: Linear(96, 100, bias=bias))
    assert lin.layout == layout
    _fill(lin)
    weight = lin.weight.detach().clone()
    b = None if lin.bias is None else lin.bias.detach().clone()
    lin.process_weights_after_loading()
    if layout in PLAIN_WEIGHT:
        assert lin.packed is None and lin.weight is not None
    else:  # the plain copy is gone: the packed one is the only one
        assert lin.weight is None and lin.packed is not None
    for rows in (1, 3, 4, 9, 64, 65, 200):  # each kernel's row range and its edges
        x = torch.randn(rows, 96)
        torch.testing.assert_close(lin(x), F.linear(x, weight, b), rtol=1e-5, atol=2e-4)
    x3 = torch.randn(2, 5, 96)
    assert lin(x3).shape == (2, 5, 100)


def test_panel_layout_routes_rows_between_its_two_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(cpu_linear, "panel_linear",
                        lambda x, p, b, n: calls.append(("c", x.shape[0])) or torch.zeros(x.shape[0], n))
    real = cpu_linear.panel_matmul
    monkeypatch.setattr(cpu_linear, "panel_matmul",
                        lambda x, p, b, n: calls.append(("torch", x.shape[0])) or real(x, p, b, n))
    lin = _built("panels", lambda: Linear(16, 50))
    _fill(lin)
    lin.packed = torch.zeros(2, 16, 48)  # what pack_panels makes (no C library needed here)
    lin.weight = None
    top = cpu_linear.PANEL_MAX_ROWS
    for rows in (1, top, top + 1):
        lin(torch.randn(rows, 16))
    assert calls == [("c", 1), ("c", top), ("torch", top + 1)]


def test_merged_and_qkv_linears_know_their_shards() -> None:
    gu = MergedLinear(16, [40, 40], bias=True)
    assert gu.shard_sizes == [40, 40] and gu.weight.shape == (80, 16)
    qkv = QKVLinear(64, head_dim=8, num_heads=8, num_kv_heads=2)
    assert qkv.shard_sizes == [64, 16, 16] and (qkv.q_size, qkv.kv_size) == (64, 16)
    assert qkv.bias is None and qkv.weight.shape == (96, 64)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tied_embedding_serves_lookup_and_head_from_one_copy(layout: str) -> None:
    emb = _built(layout, lambda: VocabEmbedding(101, 24, tied_head=True))
    _fill(emb, seed=1)
    weight = emb.weight.detach().clone()
    emb.process_weights_after_loading()
    # only the panel layout serves both; oneDNN's cannot be looked up, so plain is kept
    assert emb.layout == ("panels" if layout == "panels" else "plain")
    assert (emb.weight is None) == (layout == "panels")
    ids = torch.tensor([0, 47, 48, 100, 7])
    assert torch.equal(emb(ids), weight[ids])
    h = torch.randn(5, 24)
    torch.testing.assert_close(emb.as_head(h), F.linear(h, weight), rtol=1e-5, atol=1e-4)


def test_untied_embedding_stays_plain() -> None:
    emb = _built("panels", lambda: VocabEmbedding(10, 4, tied_head=False))
    emb.process_weights_after_loading()
    assert emb.layout == "plain" and emb.weight is not None and emb.packed is None
