"""The LoRA delta of one linear layer, for a step whose tokens run under many adapters.

A `Linear` computes its base product (whatever its stored format); with `lora` set it then
adds y += (x A^T) B^T for the rows of each adapter (`Linear.forward`, the one hook). Every
adapted layer keeps `max_loras` device slots of its A and B: A [slots, R, in], B [slots, out, R],
B scaled by the adapter's alpha / r at load (models/lora_adapter.py). A fused layer (q|k|v,
gate|up) stacks its shards' A along R, each shard `max_rank` wide, and keeps B block-diagonal,
so one shrink and one expand serve all of its shards.

Which rows run under which slot is the step's `LoRABatch`, set on the shared `LoRAContext` by
the runner before the forward (engine/lora_manager.py); without one a layer adds nothing. The
product is done per adapter segment, never per row: on CUDA by the segmented gather-matmul
kernels (`kernels/lora.py`), elsewhere by two batched matmuls over the segments padded to the
longest (the padding rows' h is zeroed, so they add exactly 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LoRABatch:
    """The rows of one step's token batch that run under an adapter, grouped by device slot."""

    token_idx: torch.Tensor  # [N] rows, grouped by slot (segments in slot order)
    seg_starts: torch.Tensor  # [S + 1] segment s is token_idx[seg_starts[s]:seg_starts[s + 1]]
    seg_slots: torch.Tensor  # [S] the slot of each segment
    max_seg_len: int
    # the padded form of the torch path: [S * Lmax] rows (padding repeats a row of its segment)
    # and [S, Lmax, 1] ones for real rows, zeros for padding
    pad_idx: torch.Tensor
    pad_mask: torch.Tensor
    # every one of the `num_slots` slots has a segment, in order: the torch path uses the slot
    # stacks as they are instead of gathering the segments' slots
    whole: bool = False
    padded: bool = True  # some segment is shorter than the longest (pad_mask has zeros)

    @classmethod
    def build(cls, token_slots: list[int], num_slots: int, device: torch.device,
              dtype: torch.dtype) -> "LoRABatch | None":
        """From each token row's slot (-1: no adapter); None when no row has one."""
        slots = torch.tensor(token_slots, dtype=torch.long)
        rows = torch.nonzero(slots >= 0).flatten()
        if rows.numel() == 0:
            return None
        order = torch.argsort(slots[rows], stable=True)
        rows = rows[order]
        seg_slots, counts = torch.unique_consecutive(slots[rows], return_counts=True)
        starts = torch.zeros(counts.numel() + 1, dtype=torch.long)
        starts[1:] = counts.cumsum(0)
        longest = int(counts.max())
        within = torch.arange(longest).unsqueeze(0)  # [1, Lmax]
        real = within < counts.unsqueeze(1)  # [S, Lmax]
        pos = starts[:-1].unsqueeze(1) + torch.minimum(within, counts.unsqueeze(1) - 1)
        whole = bool(seg_slots.numel() == num_slots
                     and torch.equal(seg_slots, torch.arange(num_slots)))
        return cls(rows.to(device), starts.to(device), seg_slots.to(device), longest,
                   rows[pos].flatten().to(device), real.unsqueeze(-1).to(device, dtype), whole,
                   bool((counts < longest).any()))


class LoRAContext:
    """The current step's `LoRABatch`, shared by every adapted layer of one model."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRADelta(nn.Module):
    """The adapters' slots of one linear layer of `in_features` → `shard_sizes` outputs."""

    def __init__(self, ctx: LoRAContext, in_features: int, shard_sizes: list[int],
                 max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype,
                 triton: bool) -> None:
        super().__init__()
        self.ctx = ctx
        self.in_features, self.shard_sizes = in_features, list(shard_sizes)
        self.out_features = sum(shard_sizes)
        self.max_rank = max_rank
        width = max_rank * len(shard_sizes)
        self.register_buffer("a", torch.zeros(max_loras, width, in_features, device=device,
                                              dtype=dtype), persistent=False)
        self.register_buffer("b", torch.zeros(max_loras, self.out_features, width,
                                              device=device, dtype=dtype), persistent=False)
        self.triton = triton

    def load(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill `slot` with an adapter's (A [r, in], scaled B [out_shard, r]) per shard; shards
        it does not adapt stay zero."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        out0 = 0
        for i, size in enumerate(self.shard_sizes):
            if i in shards:
                a, b = shards[i]
                r, col = a.shape[0], i * self.max_rank
                assert a.shape == (r, self.in_features) and b.shape == (size, r), (a.shape, b.shape)
                self.a[slot, col:col + r].copy_(a)
                self.b[slot, out0:out0 + size, col:col + r].copy_(b)
            out0 += size

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [..., out] (the base output) with each adapter's delta added in place."""
        batch = self.ctx.batch
        if batch is None:
            return y
        x2 = x.reshape(-1, self.in_features)  # [T, in]
        y2 = y.view(-1, self.out_features)  # [T, out]
        if self.triton:
            from batchgen_data.kernels import lora_expand, lora_shrink

            h = lora_shrink(x2, self.a, batch.token_idx, batch.seg_starts, batch.seg_slots,
                            batch.max_seg_len)
            lora_expand(y2, h, self.b, batch.token_idx, batch.seg_starts, batch.seg_slots,
                        batch.max_seg_len)
            return y
        segs = batch.seg_slots.shape[0]
        xs = x2.index_select(0, batch.pad_idx).view(segs, batch.max_seg_len, -1)
        a = self.a if batch.whole else self.a.index_select(0, batch.seg_slots)  # [S, R, in]
        b = self.b if batch.whole else self.b.index_select(0, batch.seg_slots)  # [S, out, R]
        h = torch.bmm(xs, a.transpose(1, 2))  # [S, Lmax, R]
        if batch.padded:  # padding rows repeat a real row: their h must add nothing
            h.mul_(batch.pad_mask)
        delta = torch.bmm(h, b.transpose(1, 2))  # [S, Lmax, out]
        y2.index_add_(0, batch.pad_idx, delta.view(-1, self.out_features))
        return y

