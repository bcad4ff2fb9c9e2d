"""moe_align_block_size and fused_experts launchers vs. their torch references (interpreter)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchgen_data.kernels import fused_experts, moe_align_block_size, reference  # noqa: E402
from kernel_test_utils import assert_close  # noqa: E402


def _routing(num_tokens: int, top_k: int, experts: list[int], skew: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """topk ids drawn from `experts` (distinct per token), or every token's first slot on
    expert `skew`; softmax-normalised float32 weights."""
    pool = torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(experts))[:top_k]] for _ in range(num_tokens)])
    if skew is not None:
        ids[:, 0] = skew
        ids[:, 1:] = torch.where(ids[:, 1:] == skew, (skew + 1) % max(experts), ids[:, 1:])
    weights = torch.softmax(torch.randn(num_tokens, top_k), -1)
    return weights, ids


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block", [
    (1, 1, 4, 16), (7, 2, 8, 16), (40, 2, 4, 16), (300, 4, 16, 32), (5, 8, 64, 16),
])
def test_align_matches_reference(num_tokens: int, top_k: int, num_experts: int,
                                 block: int) -> None:
    ids = torch.randint(0, num_experts, (num_tokens, top_k))
    got = moe_align_block_size(ids, block, num_experts)
    want = reference.moe_align_block_size(ids, block, num_experts)
    for g, w in zip(got, want):
        assert g.dtype == torch.int32
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_align_layout() -> None:
    # experts 1 and 3 idle, expert 0 gets more pairs than one block
    ids = torch.tensor([[0, 2]] * 20 + [[0, 2]]).long()  # 21 tokens, 42 pairs
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 16, 4)
    assert total.item() == 64  # expert 0: 21 pairs -> 32 rows; expert 2: 21 -> 32
    assert expert_ids[:4].tolist() == [0, 0, 2, 2] and (expert_ids[4:] == -1).all()
    assert sorted_ids[:21].tolist() == list(range(0, 42, 2))
    assert (sorted_ids[21:32] == 42).all()  # padding holds numel
    assert sorted_ids[32:53].tolist() == list(range(1, 42, 2))


def test_align_skips_ids_outside_range() -> None:
    ids = torch.tensor([[0, -1], [5, 1]])  # -1 and 5: experts held elsewhere
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 16, 2)
    assert total.item() == 32 and expert_ids[:2].tolist() == [0, 1]
    assert sorted_ids[0].item() == 0 and sorted_ids[16].item() == 3
    assert (sorted_ids[1:16] == 4).all()


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = (torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter) / inter**0.5).to(dtype)
    return w13, w2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, top_k, experts, hidden, inter, skew", [
    (3, 2, [0, 5], 32, 32, None),            # 6 of 8 experts idle
    (40, 2, [0, 1, 2, 3], 48, 40, 2),        # expert 2 gets 40 pairs: more than one block
    (17, 1, [0, 1, 2, 3, 4, 5, 6, 7], 64, 24, None),  # top-1; H, I not tile multiples
])
def test_fused_experts_matches_reference(num_tokens: int, top_k: int, experts: list[int],
                                         hidden: int, inter: int, skew: int | None,
                                         dtype: torch.dtype) -> None:
    x = torch.randn(num_tokens, hidden).to(dtype)
    w13, w2 = _weights(8, hidden, inter, dtype)
    weights, ids = _routing(num_tokens, top_k, experts, skew)
    out = fused_experts(x, w13, w2, weights, ids)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype
    assert_close(out, reference.fused_experts(x, w13, w2, weights, ids))


def test_fused_experts_block_size_does_not_change_result() -> None:
    x = torch.randn(50, 32)
    w13, w2 = _weights(4, 32, 16, torch.float32)
    weights, ids = _routing(50, 2, [0, 1, 2, 3])
    small = fused_experts(x, w13, w2, weights, ids, block_m=16)
    assert_close(fused_experts(x, w13, w2, weights, ids, block_m=64), small)


def test_reference_is_the_per_token_formula() -> None:
    # the reference itself against the interface's formula, one token and slot at a time
    x = torch.randn(4, 8, dtype=torch.float64).float()
    w13, w2 = _weights(3, 8, 6, torch.float32)
    weights, ids = _routing(4, 2, [0, 1, 2])
    want = torch.zeros(4, 8)
    for t in range(4):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = w13[e, :6] @ x[t], w13[e, 6:] @ x[t]
            want[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    assert_close(reference.fused_experts(x, w13, w2, weights, ids), want)


@pytest.mark.parametrize("kwargs, match", [
    (dict(w13=torch.randn(4, 33, 16)), "w13 must have shape"),
    (dict(w2=torch.randn(4, 16, 8).half()), "dtype"),
    (dict(topk_weights=torch.rand(3, 2).half()), "topk_weights dtype"),
    (dict(topk_ids=torch.zeros(2, 2, dtype=torch.long)), "topk_ids must have shape"),
    (dict(w13=torch.randn(4, 16, 32).transpose(1, 2)), "w13 must be contiguous"),
])
def test_fused_experts_validation(kwargs: dict, match: str) -> None:
    args = dict(hidden=torch.randn(3, 16), w13=torch.randn(4, 32, 16), w2=torch.randn(4, 16, 16),
                topk_weights=torch.rand(3, 2), topk_ids=torch.zeros(3, 2, dtype=torch.long))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        fused_experts(**args)


def test_no_tokens() -> None:
    w13, w2 = _weights(4, 16, 8, torch.float32)
    out = fused_experts(torch.randn(0, 16), w13, w2, torch.rand(0, 2),
                        torch.zeros(0, 2, dtype=torch.long))
    assert out.shape == (0, 16)
