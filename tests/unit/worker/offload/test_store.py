"""The weight store on a toy decoder stack: same outputs as resident, shared tensors stay put,
exact byte accounting for double-buffered and single-slot streaming."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from batchgen_data.worker.offload.store import WeightStore, layer_bytes, weight_bytes
from copy_order import OrderChecker


class Block(nn.Module):
    def __init__(self, shared: nn.Module, width: int) -> None:
        super().__init__()
        self.shared = shared  # like the rotary cache every Llama layer references
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width, bias=False)
        self.register_buffer("scale", torch.rand(width) + 0.5)
        self.register_buffer("calls", torch.zeros(1, dtype=torch.long))  # state: stays resident

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.down(torch.relu(self.up(self.shared(x)))) * self.scale


class Toy(nn.Module):
    def __init__(self, n: int = 5, width: int = 8, parts: bool = False) -> None:
        super().__init__()
        self.shared = nn.LayerNorm(width)
        self.layers = nn.ModuleList(Block(self.shared, width) for _ in range(n))
        self.head = nn.Linear(width, 3)
        self.parts = parts  # call each layer's parts, never the layer (as micro-batching does)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.parts:
                halves = [layer.up(layer.shared(h)) for h in x.chunk(2)]
                x = x + layer.down(torch.relu(torch.cat(halves)))
            else:
                x = layer(x)
        return self.head(x)


def _toy(parts: bool = False) -> Toy:
    torch.manual_seed(0)
    return Toy(parts=parts).eval().requires_grad_(False)


def test_layer_bytes_leave_shared_modules_out() -> None:
    model = _toy()
    own = (8 * 16 + 16) * 4 + 16 * 8 * 4 + 8 * 4  # up (w, b), down, scale
    assert layer_bytes(model, aligned=False) == [own] * 5
    assert all(b % 256 == 0 and b >= own for b in layer_bytes(model))


@pytest.mark.parametrize("slots", [2, 1])
def test_streamed_outputs_and_byte_counts(slots: int) -> None:
    model = _toy()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    total = weight_bytes(model)
    store = WeightStore(model, [1, 2, 3, 4], slots, torch.device("cpu"))
    store.finish(model)
    layer = store.layers[0].nbytes
    # the streamed tensors left the model: only layer 0, the shared norm and the head remain
    assert store.resident_bytes == total - 4 * layer_bytes(ref, aligned=False)[0]
    for step in range(1, 4):
        with torch.inference_mode():
            assert torch.equal(model(x), ref(x))
        # two slots: each step streams the 4 layers, the first step also primes layer 1 (the
        # last layer prefetches the first for the next step); one slot: each layer once a step
        want = (4 * step + 1 if slots == 2 else 4 * step) * layer
        assert store.bytes_moved == want
    assert store.peak_resident_bytes == store.resident_bytes + slots * layer
    assert [int(b.calls) for b in model.layers] == [3] * 5  # counters kept every update
    assert store.workspace_bytes == slots * layer


def test_tied_tensor_stays_resident() -> None:
    model = _toy()
    model.layers[3].up.weight = model.layers[4].up.weight  # one tensor, two layers
    store = WeightStore(model, [3, 4], 2, torch.device("cpu"))
    names = {e.name for layer in store.layers for e in layer.entries if e.module is
             model.layers[3].up}
    assert names == {"bias"}  # the shared weight is not streamed (another layer reads it)


@pytest.mark.parametrize("parts", [False, True])
@pytest.mark.parametrize("slots, streamed", [(2, [0, 1, 2, 3, 4]), (2, [2]), (1, [1, 3]),
                                             (3, [0, 2, 4])])
def test_copy_ordering_contract(slots: int, streamed: list[int], parts: bool) -> None:
    model = _toy(parts)
    ref = copy.deepcopy(model)
    store = WeightStore(model, streamed, slots, torch.device("cpu"))
    store.finish(model)
    checker = OrderChecker(slots)
    store.copier = checker
    x = torch.randn(3, 8)
    for _ in range(3):
        with torch.inference_mode():
            assert torch.equal(model(x), ref(x))
    assert checker.copies == store.bytes_moved // store.layers[0].nbytes
    # between steps only the last streamed layer's slot is held (released when layer 0 starts)
    assert sum(checker.reading) == 1
