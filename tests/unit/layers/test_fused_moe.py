"""The CPU FusedMoE against a naive per-token reference, and its implementation choice."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from batchgen_data.layers.backend import LayerBackend, building
from batchgen_data.layers import moe
from batchgen_data.layers.moe import FusedMoE, cpu_fused_experts, route

pytestmark = pytest.mark.cpu_kind


def naive_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The interface's formula, one token and one choice at a time."""
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e] @ x[t]
            h = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(weights[t, j]) * (w2[e] @ h)
    return out


def random_experts(num_experts: int, hidden: int, inter: int, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2,
            torch.randn(num_experts, hidden, inter, generator=g) * 0.2)


@pytest.mark.parametrize("tokens,experts,top_k,norm", [
    (1, 8, 2, True),      # a decode of one sequence: six experts idle
    (5, 16, 4, False),    # most experts idle, weights not renormalised
    (300, 4, 2, True),    # every expert busy with many tokens
    (37, 6, 6, False),    # top_k == num_experts
])
def test_cpu_fused_experts_match_the_per_token_reference(tokens: int, experts: int, top_k: int,
                                                         norm: bool) -> None:
    hidden, inter = 24, 12
    w13, w2 = random_experts(experts, hidden, inter, seed=tokens)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g)
    router = torch.randn(experts, hidden, generator=g)
    weights, ids = route(x @ router.t(), top_k, norm)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))
    got = cpu_fused_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, naive_experts(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


STRATEGIES = [pytest.param(moe._experts_loop, id="loop"),
              pytest.param(moe._experts_grouped, id="grouped", marks=pytest.mark.skipif(
                  not moe.GROUPED_MM, reason="this torch has no CPU _grouped_mm"))]


@pytest.mark.parametrize("experts_fn", STRATEGIES)
@pytest.mark.parametrize("tokens,experts", [(1, 8), (3, 32), (64, 5), (0, 4)])
def test_each_cpu_strategy_matches_the_reference_and_counts_skip_idle_experts(
        experts_fn, tokens: int, experts: int) -> None:
    hidden, inter, top_k = 24, 12, 2
    w13, w2 = random_experts(experts, hidden, inter, seed=7 + tokens)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, True)
    got = experts_fn(x, w13, w2, weights, ids)
    assert got.shape == (tokens, hidden)
    torch.testing.assert_close(got, naive_experts(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    if tokens:  # an expert's group is only read by its own rows: poisoned idle weights do no harm
        idle = torch.ones(experts, dtype=torch.bool)
        idle[ids.reshape(-1)] = False
        w13[idle], w2[idle] = float("nan"), float("nan")
        assert torch.isfinite(experts_fn(x, w13, w2, weights, ids)).all()


@pytest.mark.skipif(not moe.GROUPED_MM, reason="this torch has no CPU _grouped_mm")
def test_grouped_strategy_runs_the_same_matmuls_as_the_loop() -> None:
    # the grouped call walks the same per-expert products in C++: equal to the bit, so greedy
    # tokens cannot change with the strategy
    w13, w2 = random_experts(16, 64, 32, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 64, generator=g)
    weights, ids = route(torch.randn(40, 16, generator=g), 4, False)
    assert torch.equal(moe._experts_grouped(x, w13, w2, weights, ids),
                       moe._experts_loop(x, w13, w2, weights, ids))


def test_routing_matches_hf_topk_softmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.0, 2.9]])
    weights, ids = route(logits, 2, norm_topk_prob=False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[1, 3], [0, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    normed, _ = route(logits, 2, norm_topk_prob=True)
    torch.testing.assert_close(normed, weights / weights.sum(-1, keepdim=True))


def build_layer(backend: LayerBackend, shared: bool) -> FusedMoE:
    with building(backend):
        shared_mlp = torch.nn.Sequential(torch.nn.Linear(16, 8, bias=False), torch.nn.SiLU(),
                                         torch.nn.Linear(8, 16, bias=False)) if shared else None
        layer = FusedMoE(16, 8, num_experts=6, top_k=2, norm_topk_prob=False,
                         shared_expert=shared_mlp).requires_grad_(False)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


@pytest.mark.parametrize("shared", [False, True])
def test_fused_moe_layer_routes_counts_and_adds_the_shared_expert(shared: bool) -> None:
    layer = build_layer(LayerBackend(torch.device("cpu"), torch.float32), shared)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(4))
    weights, ids = route(F.linear(x, layer.gate.weight), 2, False)
    want = naive_experts(x, layer.w13, layer.w2, weights, ids)
    if shared:
        want = want + torch.sigmoid(F.linear(x, layer.shared_expert_gate.weight)) * \
            layer.shared_expert(x)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    layer(x[:2])
    counts = layer.take_expert_tokens()
    assert counts.sum() == 2 * (9 + 2)
    assert counts.tolist() == (torch.bincount(ids.reshape(-1), minlength=6)
                               + torch.bincount(ids[:2].reshape(-1), minlength=6)).tolist()
    assert layer.take_expert_tokens().sum() == 0  # taking resets the count


def test_top_k_must_fit_the_experts() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        FusedMoE(8, 4, num_experts=2, top_k=3, norm_topk_prob=True)


def test_triton_backend_uses_the_gpu_kernel_or_says_it_is_missing() -> None:
    triton_backend = LayerBackend(torch.device("cpu"), torch.float32, triton=True)
    if importlib.util.find_spec("batchgen_data.kernels.fused_moe") is None:
        with pytest.raises(ImportError, match="fused_experts"):
            build_layer(triton_backend, shared=False)
        return
    pytest.importorskip("triton")
    # the kernel runs on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py sets it)
    layer = build_layer(triton_backend, shared=False)
    ref = build_layer(LayerBackend(torch.device("cpu"), torch.float32), shared=False)
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(layer(x), ref(x), rtol=1e-4, atol=1e-4)
    assert layer.take_expert_tokens().tolist() == ref.take_expert_tokens().tolist()
