"""The AVX2 row kernel on the plain weight layout (`kernels/cpu/linear.py: rows_linear`) and the
tied output projection that uses it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen_data.kernels.cpu import linear as cpu_linear
from batchgen_data.layers.backend import LayerBackend, building
from batchgen_data.layers.embedding import VocabEmbedding

pytestmark = pytest.mark.cpu_kind

CPU = torch.device("cpu")
needs_rows_gemm = pytest.mark.skipif(not cpu_linear.rows_gemm_available(),
                                     reason="no C compiler or no AVX2/FMA here")


@needs_rows_gemm
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 32, 64, 65])  # 65: two passes over X
@pytest.mark.parametrize("shape", [(256, 64), (37, 53), (9, 8), (3, 5)])  # K and N tails
def test_rows_linear_matches_f_linear(rows: int, shape: tuple[int, int]) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(*shape)
    x = torch.randn(rows, shape[1])
    torch.testing.assert_close(cpu_linear.rows_linear(x, weight), F.linear(x, weight),
                               rtol=1e-5, atol=1e-5)
    # leading dims flatten into rows; a strided x is copied
    xt = torch.randn(shape[1], 2, rows).permute(1, 2, 0)
    torch.testing.assert_close(cpu_linear.rows_linear(xt, weight), F.linear(xt, weight),
                               rtol=1e-5, atol=1e-5)


@needs_rows_gemm
def test_rows_linear_rejects_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="rows_linear"):
        cpu_linear.rows_linear(torch.randn(2, 8), torch.randn(16, 8).t().contiguous().t())
    with pytest.raises(ValueError, match="rows_linear"):
        cpu_linear.rows_linear(torch.randn(2, 8), torch.randn(4, 9))


@needs_rows_gemm
def test_the_tied_head_uses_it_for_decode_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = LayerBackend.choose(CPU, torch.float32, head_dim=64)
    if backend.linear == "panels":
        pytest.skip("with AVX-512 the tied head lives in panels")
    with building(backend):
        emb = VocabEmbedding(300, 40, tied_head=True)
    emb.weight.data.normal_()
    emb.process_weights_after_loading()
    calls: list[int] = []
    kernel = cpu_linear.rows_linear
    monkeypatch.setattr(cpu_linear, "rows_linear",
                        lambda x, w: (calls.append(x.shape[0]), kernel(x, w))[1])
    for rows in (1, 5, 64, 65):
        x = torch.randn(rows, 40)
        torch.testing.assert_close(emb.as_head(x), F.linear(x, emb.weight), rtol=1e-5, atol=1e-5)
    assert calls == [1, 5, 64]  # prefill-sized chunks keep F.linear


def test_torch_only_and_no_rows_kernel_keep_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not LayerBackend.choose(CPU, torch.float32, cpu_kernels=False, head_dim=64).c_rows
    monkeypatch.setattr(cpu_linear, "rows_gemm_available", lambda: False)  # a CPU without it
    assert not LayerBackend.choose(CPU, torch.float32, head_dim=64).c_rows


@needs_rows_gemm
@pytest.mark.parametrize("bias", [False, True])
def test_rows_layout_runs_decode_rows_in_c_and_prefill_on_f_linear(
        bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen_data.layers.linear import Linear

    with building(LayerBackend(CPU, torch.float32, linear="rows")):
        lin = Linear(40, 70, bias=bias)
    for p in lin.parameters():
        p.data.normal_()
    lin.process_weights_after_loading()
    assert lin.packed is None and lin.weight is not None  # one copy: the plain weight
    calls: list[int] = []
    kernel = cpu_linear.rows_linear
    monkeypatch.setattr(cpu_linear, "rows_linear",
                        lambda x, w: (calls.append(x.numel() // x.shape[-1]), kernel(x, w))[1])
    for shape in ((1, 40), (5, 40), (2, 3, 40), (64, 40), (65, 40)):
        x = torch.randn(*shape)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5,
                                   atol=1e-5)
    assert calls == [1, 5, 6, 64]  # 65 rows: a prefill chunk, F.linear


def test_an_avx2_cpu_without_avx512_keeps_plain_weights_for_the_row_kernel() -> None:
    backend = LayerBackend.choose(CPU, torch.float32, head_dim=64)
    if cpu_linear.panel_gemm_available() or not cpu_linear.rows_gemm_available():
        pytest.skip("needs AVX2 without AVX-512 panels")
    assert backend.linear == "rows" and backend.c_rows
