"""The LoRA delta of one linear layer, for a step whose tokens run under many adapters.

A `Linear` computes its base product (whatever its stored format); with `lora` set it then
adds y += (x A^T) B^T for the rows of each adapter (`Linear.forward`, the one hook). Every
adapted layer keeps `max_loras` device slots: A [slots, shards x R, in] and B^T
[slots, R, out], B scaled by the adapter's alpha / r at load (models/lora_adapter.py). A fused
layer (q|k|v, gate|up) stacks its shards' A, each `max_rank` rows, so one shrink serves all of
its shards; shard i's output columns of B^T take h's columns [i R, i R + R) (no block-diagonal
zeros to multiply or store).

Which rows run under which slot is the step's `LoRABatch`, set on the shared `LoRAContext` by
the runner before the forward (worker/lora_manager.py); without one a layer adds nothing. The
product is done per adapter segment, never per row: on CUDA by the segmented gather-matmul
kernels (`kernels/lora.py`: one shrink, one expand per shard); on an fp32 CPU by one C call
that reads the rows in place (`kernels/cpu/lora.py`, also called by the C decode stack);
otherwise by plain matmuls when every row has one adapter, else batched matmuls over the
segments padded to the longest (the padding rows' h is zeroed, so they add exactly 0).
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
    # every row of the step under this one slot (rows in order): plain matmuls in the torch path
    single_slot: int | None = None
    # each token row's slot (-1: none), as `build` got them (a TP rank 0 sends them on)
    token_slots: list[int] | None = None

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
        single = int(seg_slots[0]) if rows.numel() == slots.numel() and counts.numel() == 1 \
            else None
        return cls(rows.to(device), starts.to(device), seg_slots.to(device), longest,
                   rows[pos].flatten().to(device), real.unsqueeze(-1).to(device, dtype), whole,
                   bool((counts < longest).any()), single, token_slots)


class LoRAContext:
    """The current step's `LoRABatch`, shared by every adapted layer of one model."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRADelta(nn.Module):
    """The adapters' slots of one linear layer of `in_features` → `shard_sizes` outputs.

    `kernel` (chosen once, when the manager attaches it): "triton" (CUDA), "c" (fp32 CPU with
    the C kernel, `kernels/cpu/lora.py`) or "torch"."""

    def __init__(self, ctx: LoRAContext, in_features: int, shard_sizes: list[int],
                 max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype,
                 kernel: str) -> None:
        super().__init__()
        assert kernel in ("triton", "c", "torch"), kernel
        self.ctx = ctx
        self.in_features, self.shard_sizes = in_features, list(shard_sizes)
        self.out_features = sum(shard_sizes)
        self.max_rank = max_rank
        ends = [sum(shard_sizes[:i + 1]) for i in range(len(shard_sizes))]
        self.shard_bounds = list(zip([0] + ends[:-1], ends))  # [(out0, out1)] per shard
        width = max_rank * len(shard_sizes)
        # A [slots, shards x R, in]: one shrink for every shard of a fused layer
        self.register_buffer("a", torch.zeros(max_loras, width, in_features, device=device,
                                              dtype=dtype), persistent=False)
        # B^T [slots, R, out]: shard i's columns take h's columns [i R, i R + R). Its rows are
        # padded by 16 (a view of [slots, R, out + 16]): rows a multiple of 4 KiB apart (out =
        # 3072) fall into one L1 set, which halved the C expand's speed
        self.register_buffer("bt", torch.zeros(max_loras, max_rank, self.out_features + 16,
                                               device=device, dtype=dtype)[..., :-16],
                             persistent=False)
        self.kernel = kernel
        self._c = None
        if kernel == "c":
            from batchgen_data.kernels.cpu.lora import LoRASlots

            self._c = LoRASlots(self.a, self.bt, max_rank, ends)

    def load(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill `slot` with an adapter's (A [r, in], scaled B [out_shard, r]) per shard; shards
        it does not adapt stay zero."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        for i, (out0, out1) in enumerate(self.shard_bounds):
            if i in shards:
                a, b = shards[i]
                r, col = a.shape[0], i * self.max_rank
                assert a.shape == (r, self.in_features) and b.shape == (out1 - out0, r), \
                    (a.shape, b.shape)
                self.a[slot, col:col + r].copy_(a)
                self.bt[slot, :r, out0:out1].copy_(b.T)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [..., out] (the base output) with each adapter's delta added in place."""
        batch = self.ctx.batch
        if batch is None:
            return y
        x2 = x.reshape(-1, self.in_features)  # [T, in]
        y2 = y.view(-1, self.out_features)  # [T, out]
        if self._c is not None:
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            self._c.add_(x2, y2, batch.token_idx, batch.seg_starts, batch.seg_slots)
        elif self.kernel == "triton":
            self._triton(x2, y2, batch)
        elif batch.single_slot is not None:
            self._one_adapter(x2, y2, batch.single_slot)
        else:
            self._segments(x2, y2, batch)
        return y

    def _triton(self, x2: torch.Tensor, y2: torch.Tensor, batch: LoRABatch) -> None:
        from batchgen_data.kernels import lora_expand, lora_shrink

        h = lora_shrink(x2, self.a, batch.token_idx, batch.seg_starts, batch.seg_slots,
                        batch.max_seg_len)  # [N, shards x R]
        r = self.max_rank
        for i, (out0, out1) in enumerate(self.shard_bounds):  # one expand per shard's block
            lora_expand(y2[:, out0:out1], h[:, i * r:(i + 1) * r],
                        self.bt[:, :, out0:out1].transpose(1, 2), batch.token_idx,
                        batch.seg_starts, batch.seg_slots, batch.max_seg_len)

    def _one_adapter(self, x2: torch.Tensor, y2: torch.Tensor, slot: int) -> None:
        # every row under one adapter, in order: plain matmuls, no gather or scatter
        h = x2 @ self.a[slot].T  # [T, shards x R]
        r = self.max_rank
        if len(self.shard_bounds) == 1:
            y2.addmm_(h, self.bt[slot])
            return
        # one add of the shards' products side by side: an addmm_ into each column slice of y
        # pays a strided write per shard
        y2.add_(torch.cat([h[:, i * r:(i + 1) * r] @ self.bt[slot, :, out0:out1]
                           for i, (out0, out1) in enumerate(self.shard_bounds)], -1))

    def _segments(self, x2: torch.Tensor, y2: torch.Tensor, batch: LoRABatch) -> None:
        segs = batch.seg_slots.shape[0]
        xs = x2.index_select(0, batch.pad_idx).view(segs, batch.max_seg_len, -1)
        a = self.a if batch.whole else self.a.index_select(0, batch.seg_slots)  # [S, W, in]
        bt = self.bt if batch.whole else self.bt.index_select(0, batch.seg_slots)  # [S, R, out]
        h = torch.bmm(xs, a.transpose(1, 2))  # [S, Lmax, W]
        if batch.padded:  # padding rows repeat a real row: their h must add nothing
            h.mul_(batch.pad_mask)
        r = self.max_rank
        parts = [torch.bmm(h[:, :, i * r:(i + 1) * r], bt[:, :, out0:out1])
                 for i, (out0, out1) in enumerate(self.shard_bounds)]
        delta = parts[0] if len(parts) == 1 else torch.cat(parts, -1)  # [S, Lmax, out]
        y2.index_add_(0, batch.pad_idx, delta.view(-1, self.out_features))
