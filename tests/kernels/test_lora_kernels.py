"""lora_shrink / lora_expand launchers vs. their torch references (interpreter), fp32 and fp16."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchgen_data.kernels import lora_expand, lora_shrink, reference  # noqa: E402
from kernel_test_utils import assert_close  # noqa: E402


def _segments(num_tokens: int, slots: list[int], lens: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Rows drawn at random from [0, num_tokens), `lens[s]` of them under slot `slots[s]`."""
    rows = torch.randperm(num_tokens)[:sum(lens)]
    starts = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    return rows, starts, torch.tensor(slots), max(lens, default=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, k, r, o, slots, lens", [
    (8, 64, 16, 48, [0], [8]),  # one adapter, one decode batch
    (40, 96, 48, 80, [3, 1, 0], [1, 17, 9]),  # fused q|k|v rank, odd sizes, segments > block
    (70, 32, 8, 24, [2, 0, 1, 3], [30, 2, 5, 20]),  # a rank under the tile, tokens left out
])
def test_shrink_and_expand_match_reference(dtype: torch.dtype, num_tokens: int, k: int,
                                           r: int, o: int, slots: list[int],
                                           lens: list[int]) -> None:
    tok, starts, seg_slots, longest = _segments(num_tokens, slots, lens)
    x = torch.randn(num_tokens, k).to(dtype)
    a = (torch.randn(4, r, k) / k ** 0.5).to(dtype)
    b = (torch.randn(4, o, r) / r ** 0.5).to(dtype)
    h = lora_shrink(x, a, tok, starts, seg_slots, longest)
    want_h = reference.lora_shrink(x, a, tok, starts, seg_slots, longest)
    assert h.dtype == dtype
    assert_close(h, want_h)
    y = torch.randn(num_tokens, o).to(dtype)
    want_y = reference.lora_expand(y.clone(), want_h, b, tok, starts, seg_slots, longest)
    got_y = lora_expand(y.clone(), want_h, b, tok, starts, seg_slots, longest)
    assert_close(got_y, want_y)
    untouched = torch.ones(num_tokens, dtype=torch.bool)
    untouched[tok] = False  # rows with no adapter keep the base output exactly
    assert torch.equal(got_y[untouched], y[untouched])


def test_launchers_refuse_bad_arguments() -> None:
    x, a = torch.randn(4, 32), torch.randn(2, 16, 32)
    tok, starts, slots = torch.arange(4), torch.tensor([0, 4]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="one more"):
        lora_shrink(x, a, tok, starts, slots, 4)
    with pytest.raises(ValueError, match="inputs"):
        lora_shrink(x, torch.randn(2, 16, 8), tok, starts, slots[:1], 4)
    with pytest.raises(ValueError, match="dtype"):
        lora_shrink(x.half(), a, tok, starts, slots[:1], 4)


def test_expand_takes_one_shard_of_a_fused_layer() -> None:
    # B^T stored [L, R, O] and passed transposed; h and y column slices (q|k|v's k shard)
    tok, starts, seg_slots, longest = _segments(20, [2, 0], [7, 9])
    bt = torch.randn(3, 8, 40)  # [L, R, q + k + v] with q 24, k 8, v 8
    h_all = torch.randn(16, 3 * 8)  # [N, shards x R]
    y = torch.randn(20, 40)
    got = lora_expand(y.clone()[:, 24:32], h_all[:, 8:16], bt[:, :, 24:32].transpose(1, 2),
                      tok, starts, seg_slots, longest)
    want = reference.lora_expand(y.clone()[:, 24:32], h_all[:, 8:16].contiguous(),
                                 bt[:, :, 24:32].transpose(1, 2).contiguous(), tok, starts,
                                 seg_slots, longest)
    assert_close(got, want)
    whole = y.clone()
    lora_expand(whole[:, 24:32], h_all[:, 8:16], bt[:, :, 24:32].transpose(1, 2), tok, starts,
                seg_slots, longest)
    assert torch.equal(whole[:, :24], y[:, :24]) and torch.equal(whole[:, 32:], y[:, 32:])
    assert_close(whole[:, 24:32], want)
