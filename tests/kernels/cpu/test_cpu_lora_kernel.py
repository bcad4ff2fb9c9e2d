"""The C LoRA kernel (`kernels/cpu/lora.py`, `csrc/lora.c`) against its unfused reference: fused
shards of unequal sizes, segments of unequal lengths (one row, over one block of rows), rows of
the base model left untouched, the same bits on one thread and two."""
from __future__ import annotations

import pytest
import torch

from batchgen_data.kernels.cpu import lora as cpu_lora

pytestmark = [pytest.mark.cpu_kind,
              pytest.mark.skipif(not cpu_lora.available(),
                                 reason="no C compiler or no AVX2/FMA here")]


def _case(tokens: int, k: int, rank: int, sizes: list[int], segs: list[tuple[int, int]],
          seed: int, slots: int = 4) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g)
    a = torch.randn(slots, len(sizes) * rank, k, generator=g) / k ** 0.5
    bt = torch.randn(slots, rank, sum(sizes), generator=g) / rank ** 0.5
    ends = torch.tensor(sizes).cumsum(0)
    tok = torch.randperm(tokens, generator=g)[:sum(n for _, n in segs)]
    starts = torch.tensor([0] + [n for _, n in segs]).cumsum(0)
    seg_slots = torch.tensor([s for s, _ in segs], dtype=torch.long)
    y = torch.randn(tokens, sum(sizes), generator=g)
    return x, y, a, bt, ends, tok, starts, seg_slots


@pytest.mark.parametrize("tokens, k, rank, sizes, segs", [
    (32, 576, 16, [576, 192, 192], [(i % 4, 4) for i in range(8)]),  # a decode step's q|k|v
    (9, 37, 5, [19, 7, 7], [(3, 1), (0, 5), (2, 2)]),  # odd sizes: K and column tails
    (100, 64, 8, [40, 40], [(1, 70), (3, 1), (0, 20)]),  # gate|up, a segment past a block
    (12, 48, 1, [23], [(2, 6)]),  # rank 1, half the rows under the base model
])
def test_matches_the_unfused_reference(tokens: int, k: int, rank: int, sizes: list[int],
                                       segs: list[tuple[int, int]]) -> None:
    x, y, a, bt, ends, tok, starts, slots = _case(tokens, k, rank, sizes, segs, seed=tokens)
    want = cpu_lora.reference_add_(x, y.clone(), a, bt, rank, ends, tok, starts, slots)
    got = cpu_lora.lora_add_(x, y.clone(), a, bt, rank, ends, tok, starts, slots, 1)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    base = torch.ones(tokens, dtype=torch.bool)
    base[tok] = False
    assert torch.equal(got[base], y[base])  # rows with no adapter: the base output exactly
    assert (got[tok] != y[tok]).any()
    two = cpu_lora.lora_add_(x, y.clone(), a, bt, rank, ends, tok, starts, slots, 2)
    assert torch.equal(two, got)  # each row's sums in one order, whatever the threads


def test_big_steps_split_over_threads_give_the_same_bits() -> None:
    # a prefill-sized step: enough work that the kernel wakes its threads
    x, y, a, bt, ends, tok, starts, slots = _case(600, 256, 16, [256, 64, 64],
                                                  [(0, 300), (2, 250), (1, 3)], seed=1)
    one = cpu_lora.lora_add_(x, y.clone(), a, bt, 16, ends, tok, starts, slots, 1)
    two = cpu_lora.lora_add_(x, y.clone(), a, bt, 16, ends, tok, starts, slots, 2)
    assert torch.equal(one, two)
    want = cpu_lora.reference_add_(x, y.clone(), a, bt, 16, ends, tok, starts, slots)
    assert torch.allclose(one, want, rtol=1e-5, atol=1e-4)


def test_rows_and_b_rows_read_in_place_at_their_stride() -> None:
    x, y, a, bt, ends, tok, starts, slots = _case(10, 40, 4, [24], [(1, 6)], seed=2)
    wide = torch.randn(10, 64)
    wide[:, 8:48] = x
    got = cpu_lora.lora_add_(wide[:, 8:48], y.clone(), a, bt, 4, ends, tok, starts, slots)
    assert torch.equal(got, cpu_lora.lora_add_(x, y.clone(), a, bt, 4, ends, tok, starts, slots))
    padded = torch.zeros(bt.shape[0], bt.shape[1], bt.shape[2] + 16)[..., :-16]
    padded.copy_(bt)  # B^T rows further apart than their length, as the layers keep them
    assert torch.equal(got, cpu_lora.lora_add_(x, y.clone(), a, padded, 4, ends, tok, starts,
                                               slots))


def test_refuses_bad_arguments() -> None:
    x, y, a, bt, ends, tok, starts, slots = _case(8, 32, 4, [16, 8], [(0, 3)], seed=3)
    with pytest.raises(ValueError, match="float32"):
        cpu_lora.lora_add_(x.double(), y, a, bt, 4, ends, tok, starts, slots)
    with pytest.raises(ValueError, match="a "):
        cpu_lora.lora_add_(x, y, a[:, :4], bt, 4, ends, tok, starts, slots)
    with pytest.raises(ValueError, match="bt"):
        cpu_lora.lora_add_(x, y, a, bt[:, :, :16], 4, ends, tok, starts, slots)
    with pytest.raises(ValueError, match=r"\[T, 24\]"):
        cpu_lora.lora_add_(x, y[:, :16], a, bt, 4, ends, tok, starts, slots)
    with pytest.raises(ValueError, match="strides"):
        cpu_lora.lora_add_(x, y, a, bt.transpose(1, 2).contiguous().transpose(1, 2), 4, ends,
                           tok, starts, slots)
    with pytest.raises(ValueError, match="int64"):
        cpu_lora.lora_add_(x, y, a, bt, 4, ends, tok.int(), starts, slots)
