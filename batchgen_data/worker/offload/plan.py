"""The offload cost model: what stays resident, how many workspace slots, how big a step.

Inputs are the model's byte counts and two measured rates of the machine (`measure_rates`):
host-to-device copy bandwidth B (bytes/s) and the device's matmul rate F (flop/s) in the
model's dtype. A streamed layer of S bytes and P parameters costs S / B to copy and about
2 * a * P / F per token to compute (a: the fraction of its parameters a token uses, k/E for a
mixture of experts). The copy of layer i+1 hides under the compute of layer i once a step
carries at least

    T* = S / B  /  (2 * a * P / F)  =  F * (S / P) / (2 * a * B)   tokens,

so the plan raises the scheduler's token and sequence caps to T* (when the user left them at
their defaults): module-based batching, each streamed layer used by as many tokens as possible.
docs/offload.md derives it and lists measured rates.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Rates:
    copy_bytes_per_s: float  # host -> device
    flops_per_s: float  # dense matmul in the model's dtype


@dataclass(frozen=True, slots=True)
class OffloadPlan:
    offloaded: tuple[int, ...]  # decoder layer indices streamed from host memory
    num_slots: int  # device workspace slots (2: double-buffered)
    budget_bytes: int  # device weight budget: total weights - cpu_offload_gb
    resident_bytes: int  # weights kept on the device (non-layer tensors, resident layers)
    slot_bytes: int
    target_tokens: int  # tokens per step for a streamed layer's copy to hide under compute

    @property
    def peak_bytes(self) -> int:
        """The most weight bytes the device can hold at once under this plan."""
        return self.resident_bytes + self.num_slots * self.slot_bytes


def choose_layers(layer_bytes: list[int], other_bytes: int, budget: int
                  ) -> tuple[tuple[int, ...], int]:
    """The fewest decoder layers to stream (largest first, later layers first among equals)
    and the slot count (2 where the budget allows, else 1) so that resident weights plus the
    workspace fit `budget`. Raises ValueError when even one layer's slot does not fit."""
    order = sorted(range(len(layer_bytes)), key=lambda i: (-layer_bytes[i], -i))
    resident = other_bytes + sum(layer_bytes)
    chosen: list[int] = []
    for slots in (2, 1):
        chosen, resident_now = [], resident
        for i in order:
            chosen.append(i)
            resident_now -= layer_bytes[i]
            if resident_now + slots * max(layer_bytes[j] for j in chosen) <= budget:
                return tuple(sorted(chosen)), slots
    need = other_bytes + max(layer_bytes)
    raise ValueError(f"cpu_offload_gb / weight_memory_bytes leave a device weight budget of "
                     f"{budget} bytes; streaming needs at least {need} (the non-layer weights "
                     "plus one layer's slot)")


def target_tokens(rates: Rates, slot_bytes: int, layer_params: int, active_fraction: float
                  ) -> int:
    copy_s = slot_bytes / rates.copy_bytes_per_s
    compute_s_per_token = 2 * active_fraction * layer_params / rates.flops_per_s
    return max(1, math.ceil(copy_s / compute_s_per_token))


def make_plan(layer_bytes: list[int], other_bytes: int, budget: int, rates: Rates,
              layer_params: int, active_fraction: float = 1.0) -> OffloadPlan:
    """The plan for a device weight budget of `budget` bytes (streaming workspace included)."""
    total = other_bytes + sum(layer_bytes)
    offloaded, slots = choose_layers(layer_bytes, other_bytes, budget)
    slot = max(layer_bytes[i] for i in offloaded)
    resident = total - sum(layer_bytes[i] for i in offloaded)
    tokens = target_tokens(rates, slot, layer_params, active_fraction)
    return OffloadPlan(offloaded, slots, budget, resident, slot, tokens)


def micro_batch_seqs(num_seqs: int, exposed_s_per_seq: float, call_s: float) -> int:
    """Sequences per swapped KV micro-batch (docs/offload.md, "Micro-batch size").

    `num_seqs` host-tier sequences attend in micro-batches of m: each micro-batch pays a fixed
    `call_s` (launches, metadata, a sync), and with double-buffered staging the copy of one
    micro-batch runs under the attention of the one before, so of the two pipeline stages only
    the smaller one of one micro-batch stays exposed (the fill): `exposed_s_per_seq` per
    sequence. A layer then takes about (n / m) * o + m * e + (terms free of m), least at
    m* = sqrt(n * o / e), at least 1 and at most n."""
    assert num_seqs > 0 and call_s >= 0 and exposed_s_per_seq >= 0
    if exposed_s_per_seq == 0:
        return num_seqs
    return max(1, min(num_seqs, math.ceil(math.sqrt(num_seqs * call_s / exposed_s_per_seq))))


def _timed(fn, reps: int, sync) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up (allocations, kernel selection)
    sync()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_rates(device: torch.device, dtype: torch.dtype, copy_bytes: int = 32 << 20,
                  reps: int = 3) -> Rates:
    """Times a pinned host -> device copy of `copy_bytes` and a square matmul on `device`
    (best of `reps`). Sizes are small so an engine's start stays quick; on the CPU "device" the
    copy is a host memcpy, which is what the CPU path really pays."""
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    src = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    copy_s = _timed(lambda: dst.copy_(src, non_blocking=cuda), reps, sync)
    n = 4096 if cuda else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    mm_s = _timed(lambda: a @ b, reps, sync)
    return Rates(copy_bytes / copy_s, 2 * n ** 3 / mm_s)
