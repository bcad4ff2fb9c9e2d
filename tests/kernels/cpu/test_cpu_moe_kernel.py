"""The C MoE experts kernel (`kernels/cpu/moe.py`) against the per-token formula and the torch
path of `FusedMoE`."""
from __future__ import annotations

import pytest
import torch

from batchgen_data.kernels.cpu import moe as cpu_moe
from batchgen_data.layers import moe
from batchgen_data.layers.backend import LayerBackend, building
from kernel_test_utils import assert_close_sum

pytestmark = pytest.mark.cpu_kind

needs_moe_kernel = pytest.mark.skipif(not cpu_moe.available(),
                                      reason="no C compiler or no AVX2/FMA here")


def random_experts(experts: int, hidden: int, inter: int, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5,
            torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5)


def random_route(tokens: int, experts: int, top_k: int, seed: int, used: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing over the first `used` experts (the rest get no token)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g) * 2
    if used is not None:
        logits[:, used:] = float("-inf")
    return moe.route(logits, top_k, norm_topk_prob=False)


@needs_moe_kernel
@pytest.mark.parametrize("tokens", [1, 2, 5, 17, 64])
@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
@pytest.mark.parametrize("hidden,inter", [(64, 32), (37, 21), (96, 13)])  # odd: K tails, col tails
def test_matches_the_per_token_formula(tokens: int, top_k: int, hidden: int, inter: int) -> None:
    experts = 12
    w13, w2 = random_experts(experts, hidden, inter, seed=tokens + top_k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(hidden))
    # top_k + 2 usable experts: most of the 12 get no token at all
    weights, ids = random_route(tokens, experts, top_k, seed=inter, used=top_k + 2)
    got = cpu_moe.moe_experts(x, w13, w2, weights, ids)
    want = cpu_moe.reference(x, w13, w2, weights, ids)
    assert_close_sum(got, want, k=hidden + inter + top_k)


@needs_moe_kernel
def test_two_experts_take_every_row_past_one_tile() -> None:
    # every token picks experts 3 and 0: two experts hold all rows, with more than a 64-row tile
    w13, w2 = random_experts(6, 40, 24, seed=1)
    x = torch.randn(64, 40)
    ids = torch.tensor([[3, 0]] * 64)
    weights = torch.rand(64, 2)
    assert_close_sum(cpu_moe.moe_experts(x, w13, w2, weights, ids),
                     cpu_moe.reference(x, w13, w2, weights, ids), k=40 + 24 + 2)


@needs_moe_kernel
def test_many_experts_for_one_token() -> None:
    # more experts than pairs and a tiny width: the per-expert bookkeeping outgrows the pairs'
    w13, w2 = random_experts(64, 8, 8, seed=4)
    x = torch.randn(1, 8)
    weights, ids = random_route(1, 64, 1, seed=5)
    assert_close_sum(cpu_moe.moe_experts(x, w13, w2, weights, ids),
                     cpu_moe.reference(x, w13, w2, weights, ids), k=8 + 8 + 1)


@needs_moe_kernel
def test_matches_the_torch_path_at_the_benchmark_shape() -> None:
    w13, w2 = random_experts(32, 512, 256, seed=2)
    x = torch.randn(32, 512)
    weights, ids = random_route(32, 32, 4, seed=3)
    torch.testing.assert_close(cpu_moe.moe_experts(x, w13, w2, weights, ids),
                               moe.cpu_fused_experts(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


@needs_moe_kernel
def test_rejects_bad_ids_and_layouts() -> None:
    w13, w2 = random_experts(4, 16, 8, seed=0)
    x, weights = torch.randn(2, 16), torch.rand(2, 1)
    with pytest.raises(ValueError, match="out of"):
        cpu_moe.moe_experts(x, w13, w2, weights, torch.tensor([[1], [4]]))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_moe.moe_experts(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights,
                            torch.tensor([[1], [2]]))
    with pytest.raises(ValueError, match="w2"):
        cpu_moe.moe_experts(x, w13, w2[:, :8], weights, torch.tensor([[1], [2]]))


@needs_moe_kernel
def test_the_layer_uses_it_for_few_tokens_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    kernel = cpu_moe.moe_experts
    monkeypatch.setattr(cpu_moe, "moe_experts",
                        lambda x, *a: (calls.append(x.shape[0]), kernel(x, *a))[1])
    cpu = torch.device("cpu")
    with building(LayerBackend.choose(cpu, torch.float32, head_dim=64)):
        layer = moe.FusedMoE(24, 16, num_experts=6, top_k=2, norm_topk_prob=True)
    with building(LayerBackend.choose(cpu, torch.float32, cpu_kernels=False, head_dim=64)):
        plain = moe.FusedMoE(24, 16, num_experts=6, top_k=2, norm_topk_prob=True)
    torch.manual_seed(0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    plain.load_state_dict(layer.state_dict())
    with torch.no_grad():
        for tokens in (1, cpu_moe.MAX_TOKENS, cpu_moe.MAX_TOKENS + 1):
            x = torch.randn(tokens, 24)
            # the C kernel and torch's grouped matmuls add in different orders (a 1.07e-6
            # difference on an AVX-512 box failed the old atol=1e-6): sums of 24 + 16 + 2 terms
            assert_close_sum(layer(x), plain(x), k=24 + 16 + 2)
    assert calls == [1, cpu_moe.MAX_TOKENS]  # the longer chunk kept torch's grouped matmuls


def test_without_the_kernel_layers_keep_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_moe, "available", lambda: False)  # a CPU where it does not build
    assert not LayerBackend.choose(torch.device("cpu"), torch.float32, head_dim=64).c_moe
