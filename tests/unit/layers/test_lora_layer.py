"""`LoRADelta` (layers/lora.py) on each of its CPU kernels against an unfused per-module
reference: the fused q|k|v shrink and the per-shard expand give what q, k and v adapted one at a
time give, in steps that mix adapters and base rows, with segments of unequal lengths, with one
adapter for every row (the plain-matmul path) and with every slot in use."""
from __future__ import annotations

import pytest
import torch

from batchgen_data.kernels.cpu import lora as cpu_lora
from batchgen_data.layers.lora import LoRABatch, LoRAContext, LoRADelta

pytestmark = pytest.mark.cpu_kind

KERNELS = ["torch"] + (["c"] if cpu_lora.available() else [])
SIZES = [48, 16, 16]  # q, k, v
HIDDEN, RANK, SLOTS = 40, 8, 3


def _delta(kernel: str, seed: int) -> tuple[LoRADelta, dict[int, dict[int, tuple]]]:
    """Three adapters of unequal ranks; adapter 2 leaves k unadapted."""
    delta = LoRADelta(LoRAContext(), HIDDEN, SIZES, SLOTS, RANK, torch.device("cpu"),
                      torch.float32, kernel)
    g = torch.Generator().manual_seed(seed)
    adapters = {}
    for slot, rank in enumerate((8, 3, 5)):
        shards = {i: (torch.randn(rank, HIDDEN, generator=g),
                      torch.randn(size, rank, generator=g) * 0.1)
                  for i, size in enumerate(SIZES) if not (slot == 2 and i == 1)}
        delta.load(slot, shards)
        adapters[slot] = shards
    return delta, adapters


def _unfused(x: torch.Tensor, y: torch.Tensor, adapters: dict, token_slots: list[int]
             ) -> torch.Tensor:
    """Each row, each projection on its own: y_shard += x A^T B^T (float64)."""
    out = y.double().clone()
    bounds = torch.tensor([0] + SIZES).cumsum(0).tolist()
    for row, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for i, (a, b) in adapters[slot].items():
            out[row, bounds[i]:bounds[i + 1]] += x[row].double() @ a.double().T @ b.double().T
    return out.float()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("token_slots", [
    [0, -1, 1, 0, 2, -1, 0, 0, 1],  # adapters and base rows mixed, segments of 4, 2 and 1
    [1] * 7,  # one adapter for every row: plain matmuls
    [2, 0, 1, 1, 0, 2],  # every slot in use: the slot stacks as they are
    [-1, 2, -1],  # one adapter, base rows around it
])
def test_fused_delta_matches_the_unfused_reference(kernel: str, token_slots: list[int]) -> None:
    delta, adapters = _delta(kernel, seed=len(token_slots))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(len(token_slots), HIDDEN, generator=g)
    y = torch.randn(len(token_slots), sum(SIZES), generator=g)
    batch = LoRABatch.build(token_slots, SLOTS, torch.device("cpu"), torch.float32)
    assert (batch.single_slot is not None) == (len(set(token_slots)) == 1)
    delta.ctx.batch = batch
    got = delta(x, y.clone())
    want = _unfused(x, y, adapters, token_slots)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    base = torch.tensor(token_slots) < 0
    assert torch.equal(got[base], y[base])  # base rows: the base output exactly


@pytest.mark.parametrize("kernel", KERNELS)
def test_no_batch_adds_nothing(kernel: str) -> None:
    delta, _ = _delta(kernel, seed=0)
    y = torch.randn(4, sum(SIZES))
    assert torch.equal(delta(torch.randn(4, HIDDEN), y.clone()), y)


def test_reloading_a_slot_clears_the_last_adapter() -> None:
    delta, _ = _delta("torch", seed=1)
    delta.load(0, {2: (torch.ones(2, HIDDEN), torch.ones(SIZES[2], 2))})
    assert delta.a[0, :2 * RANK].abs().sum() == 0 and delta.a[0, 2 * RANK:2 * RANK + 2].all()
    assert delta.bt[0, :, :SIZES[0] + SIZES[1]].abs().sum() == 0
    assert delta.bt[0, 2:].abs().sum() == 0  # rows past the adapter's rank
