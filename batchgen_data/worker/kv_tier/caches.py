"""The KV host tier's caches: host blocks, the staging they swap through, and the caches each
host micro-batch attends in.

A host micro-batch attends one of two ways (`cost.choose_mode`): **swap** copies its KV blocks
into a small device staging cache (double-buffered: the next swapped micro-batch's blocks copy
while this one attends, `staging.py`), runs the device's own attention kernel there, and copies
the new tokens' K/V (a few rows) back to the host blocks; **host** attends on the host cache
itself (the `Attention` layer attends a cache on another device where that cache is). Both
compute exactly what the resident path computes (the same formula on the same values).
`HostKVCaches` counts the bytes each way moves.
"""
from __future__ import annotations

import math

import torch

from batchgen_data.layers.attention import AttentionMetadata
from batchgen_data.layers.backend import LayerBackend
from batchgen_data.worker.kv_tier.batch import MicroBatch, metadata
from batchgen_data.worker.kv_tier.cost import Mode
from batchgen_data.worker.kv_tier.staging import KVStaging


class HostTierCaches:
    """The KV caches of a host-tier micro-batch, as the model reads them: one (k, v) per
    layer. Reading layer ``i`` makes the tier ready for that layer's attention (`caches_at`):
    swap mode stages the batch's blocks of layer ``i`` in a device staging cache, host mode
    gives the host caches themselves (the attention layer attends where its cache is)."""

    def __init__(self, tier: "HostKVCaches", batch: MicroBatch, mode: Mode) -> None:
        self.tier, self.batch, self.mode = tier, batch, mode

    def __len__(self) -> int:
        return len(self.tier.host_caches)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tier.caches_at(layer, self.batch, self.mode)


class HostKVCaches:
    """The host caches of the KV host tier of one engine ([num_host_blocks, block_size, Hkv, D]
    per layer, k and v), two device staging caches of `staging_blocks` blocks (one swapped
    micro-batch of one layer each: `KVStaging`), and the counters. It answers, for a host
    micro-batch, the metadata its attention uses (`metadata_for`) and the caches it attends
    in (`caches_for`); the model and its layers see only caches and metadata.

    A swapped micro-batch's new K/V land in staging; they are copied to its host blocks when
    the next micro-batch asks for its caches, or at `flush` (the runner calls it after each
    forward), and only then is the staging slot released for the next copy."""

    def __init__(self, host_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 staging_blocks: int, device: torch.device, backend: LayerBackend,
                 num_heads: int) -> None:
        k0 = host_caches[0][0]
        self.host_caches = host_caches
        self.block_size, self.num_kv_heads, self.head_dim = k0.shape[1:]
        self.itemsize = k0.element_size()
        self.num_heads = num_heads
        self.device, self.backend = device, backend
        self.staging = KVStaging(host_caches, staging_blocks, device)
        self._host_to_device = 0  # host mode's outputs (swap mode's blocks: `staging`)
        self.bytes_to_host = 0
        # a swapped micro-batch that attended in staging, its new rows not yet on the host:
        # (layer, slot, its staging slots, its host slots)
        self._pending: tuple[int, int, torch.Tensor, torch.Tensor] | None = None

    @property
    def bytes_to_device(self) -> int:
        return self._host_to_device + self.staging.bytes_copied

    def plan(self, swapped: list[MicroBatch]) -> None:
        """The step's swapped micro-batches in the order each layer attends them, so that the
        next one's blocks copy while one attends (`KVStaging`)."""
        self.staging.plan([(id(b), b.tables) for b in swapped])

    @staticmethod
    def staged_tables(batch: MicroBatch) -> list[list[int]]:
        """`batch`'s tables in staging block ids: the batch's host blocks in sorted order are
        staging blocks 0, 1, ... (as `KVStaging` lays them out)."""
        local = {b: i for i, b in enumerate(sorted({b for t in batch.tables for b in t}))}
        return [[local[b] for b in t] for t in batch.tables]

    def metadata_for(self, batch: MicroBatch, mode: Mode) -> AttentionMetadata:
        """The attention metadata of `batch` attending in `mode`: staging block ids on the
        device (swap), or its host block ids on the host (host)."""
        if mode == "swap":
            dev = MicroBatch(self.staged_tables(batch), batch.seq_lens, batch.query_lens)
            return metadata(dev, self.block_size, self.device, self.backend.torch_decode_attention)
        return metadata(batch, self.block_size, torch.device("cpu"), torch_decode=True)

    def caches_for(self, batch: MicroBatch, mode: Mode) -> HostTierCaches:
        return HostTierCaches(self, batch, mode)

    def caches_at(self, layer: int, batch: MicroBatch, mode: Mode
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s caches for `batch`'s attention (see the class)."""
        self.flush()
        tokens = sum(batch.query_lens)
        kv_row = self.num_kv_heads * self.head_dim * self.itemsize
        if mode == "host":  # q, k, v go to the host, the output comes back
            self.bytes_to_host += tokens * (self.num_heads * self.head_dim * self.itemsize
                                            + 2 * kv_row)
            self._host_to_device += tokens * self.num_heads * self.head_dim * self.itemsize
            return self.host_caches[layer]
        staging, _, slot = self.staging.acquire(layer, id(batch), batch.tables)
        local = MicroBatch(self.staged_tables(batch), batch.seq_lens, batch.query_lens)
        cpu = torch.device("cpu")
        self._pending = (layer, slot,
                         metadata(local, self.block_size, cpu, False).slot_mapping.to(self.device),
                         metadata(batch, self.block_size, cpu, False).slot_mapping)
        self.bytes_to_host += 2 * tokens * kv_row
        return staging[0], staging[1]

    def flush(self) -> None:
        """Copy the last swapped micro-batch's new K/V rows from staging to its host blocks
        and release its staging slot."""
        if self._pending is None:
            return
        layer, slot, staged, host_slots = self._pending
        self._pending = None
        for dst, src in zip(self.host_caches[layer], self.staging.slots[slot]):
            rows = src.view(-1, *src.shape[2:]).index_select(0, staged)
            dst.view(-1, *dst.shape[2:])[host_slots] = rows.to("cpu")
        self.staging.release(slot)  # after the reads above: the slot may be refilled


def staging_blocks_for(max_seqs: int, max_len: int, block_size: int) -> int:
    """Staging blocks one swapped micro-batch of `max_seqs` sequences up to `max_len` needs."""
    return max_seqs * math.ceil(max_len / block_size)
