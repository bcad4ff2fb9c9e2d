"""The KV host tier of one engine: what the runner asks of it.

The block pool's ids from `num_device_blocks` up name blocks of the host caches kept here
(pinned on CUDA, plain memory on the CPU "device"); the pool only counts them. Module-based
batching runs each (streamed) weight module once over a step larger than the device KV cache
holds: a step whose sequences sit partly in the host tier is laid out as micro-batches
(`groups`): the device-tier sequences first, then the host-tier ones in groups whose blocks fit
the device staging cache. `attention` turns that layout into the step's `AttentionMetadata`,
whose micro-batches each name the caches their KV is in (the step's own, or the tier's,
`caches.py`), each host micro-batch attending the way `cost.choose_mode` picks from the rates
measured once when the engine starts. `end_step` sends the last swapped rows home after the
forward; `holding` says where hold/resume and export/import find a sequence's blocks.
"""
from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import nn

from batchgen_data.core.kv.planes import kv_planes, layer_caches
from batchgen_data.layers.attention import AttentionMetadata, AttentionPart
from batchgen_data.layers.backend import LayerBackend
from batchgen_data.worker.kv_tier.batch import MicroBatch, metadata
from batchgen_data.worker.kv_tier.caches import HostKVCaches, staging_blocks_for
from batchgen_data.worker.kv_tier.cost import (KVRates, Mode, choose_mode, measure_kv_rates,
                                               swap_exposed_s)
from batchgen_data.worker.offload.copy import host_buffer
from batchgen_data.worker.offload.plan import micro_batch_seqs

# the device staging cache holds one layer's KV of this many sequences at max_model_len: a
# memory bound on a swapped micro-batch (its size in sequences comes from the cost model)
STAGING_SEQS = 16


class HostKVTier:
    """Host caches, staging, placement and counters of one engine's KV host tier."""

    def __init__(self, model: nn.Module, num_device_blocks: int, num_host_blocks: int,
                 block_size: int, max_model_len: int, backend: LayerBackend,
                 rates: KVRates | None = None) -> None:
        assert num_host_blocks > 0
        s = model.shape
        self.shape = s
        self.first_host_block = num_device_blocks
        self.block_size = block_size
        self.device = backend.device
        self.itemsize = torch.finfo(backend.kv_dtype).bits // 8  # an FP8 cache's: 1
        self.torch_decode = backend.torch_decode_attention
        # [layers, planes, num_host_blocks, block_size, Hkv, D] in the device cache's dtype (FP8
        # codes stay codes: the layers' scales read them wherever they are), page-locked at its
        # exact size on CUDA (torch's pinned allocator would round a 100 GB tier up to 128 GB)
        shape = (s.num_layers, kv_planes(s), num_host_blocks, block_size, s.num_kv_heads,
                 s.head_dim)
        nbytes = math.prod(shape) * self.itemsize
        self._buffer = host_buffer(nbytes, self.device)  # owns the registration
        self.kv = self._buffer.view(backend.kv_dtype).view(shape).zero_()
        caches = layer_caches(self.kv)
        self.staging_blocks = min(num_host_blocks, staging_blocks_for(
            STAGING_SEQS, max_model_len, block_size))
        self.caches = HostKVCaches(caches, self.staging_blocks, self.device, backend,
                                   s.num_heads)
        self.rates = rates or measure_kv_rates(self.device, backend.dtype)
        self.host_seqs_peak = 0  # most host-tier sequences in one step
        self.modes = {"swap": 0, "host": 0}  # host micro-batches served each way
        self.micro_batch_seqs_last = 0  # the size the cost model chose for the last step

    @property
    def bytes_moved(self) -> int:
        """KV-tier bytes over the host <-> device link so far (both directions)."""
        return self.caches.bytes_to_device + self.caches.bytes_to_host

    def on_host(self, block_ids: list[int]) -> bool:
        return bool(block_ids) and block_ids[0] >= self.first_host_block

    def local(self, block_ids: list[int]) -> list[int]:
        """Host block ids as rows of the host caches."""
        return [b - self.first_host_block for b in block_ids]

    def groups(self, tables: Seq[list[int]], seq_lens: Seq[int], query_lens: Seq[int]
               ) -> list[list[int]] | None:
        """The step's micro-batches as lists of scheduled indices (device ones, then host
        groups; decodes first inside each), or None when no sequence of the step is in the
        host tier (the plain forward runs). The host sequences form one group when the host
        attends cheaper than a swap (nothing to stage); else groups of `micro_batch_seqs`
        sequences (the cost model's size, `plan.micro_batch_seqs`) whose blocks fit staging."""
        host = [i for i, t in enumerate(tables) if self.on_host(t)]
        if not host:
            return None
        self.host_seqs_peak = max(self.host_seqs_peak, len(host))
        out: list[list[int]] = []
        device = [i for i, t in enumerate(tables) if not self.on_host(t)]
        if device:
            out.append(device)
        size, staged = self.micro_batch_size(MicroBatch(
            [tables[i] for i in host], [seq_lens[i] for i in host], [query_lens[i] for i in host]))
        self.micro_batch_seqs_last = size
        group: list[int] = []
        blocks = 0
        for i in host:
            n = len(tables[i])
            if group and (len(group) == size or (staged and blocks + n > self.staging_blocks)):
                out.append(group)
                group, blocks = [], 0
            group.append(i)
            blocks += n
        out.append(group)
        return [sorted(g, key=lambda i: query_lens[i] != 1) for g in out]

    def micro_batch_size(self, batch: MicroBatch) -> tuple[int, bool]:
        """(sequences per host micro-batch, whether they swap through staging) for this step's
        host-tier sequences `batch`: all of them, unstaged, when attending on the host wins
        for the lot; else the cost model's size."""
        s, n = self.shape, len(batch.tables)
        args = (s.num_heads, s.num_kv_heads, s.head_dim, self.itemsize, self.rates)
        if choose_mode(batch, *args) == "host":
            return n, False
        return micro_batch_seqs(n, swap_exposed_s(batch, *args), self.rates.call_s), True

    def attention(self, groups: list[list[int]], tables: Seq[list[int]], seq_lens: Seq[int],
                  query_lens: Seq[int]) -> AttentionMetadata:
        """The step's attention as the micro-batches of `groups` (the step's tokens being the
        groups' tokens one after another); each host group's mode is chosen here."""
        s = self.shape
        placed = []
        for g in groups:
            host = self.on_host(tables[g[0]])
            batch = MicroBatch([self.local(tables[i]) if host else list(tables[i]) for i in g],
                               [seq_lens[i] for i in g], [query_lens[i] for i in g])
            mode = None
            if host:
                mode = choose_mode(batch, s.num_heads, s.num_kv_heads, s.head_dim,
                                   self.itemsize, self.rates)
                if sum(map(len, batch.tables)) > self.staging_blocks:
                    mode = "host"  # a group sized for host attention cannot be staged
                self.modes[mode] += 1
            placed.append(Placed(batch, mode))
        return AttentionMetadata.in_micro_batches(micro_batches(
            placed, self.caches, self.block_size, self.device, self.torch_decode))

    def end_step(self) -> None:
        """After a step's forward: the last swapped micro-batch's new rows go to the host."""
        self.caches.flush()

    def holding(self, block_ids: list[int]) -> tuple[torch.Tensor, list[int]] | None:
        """The host cache [layers, planes, blocks, block_size, Hkv, D] these blocks (all of one
        tier) live in and their rows there, or None for device blocks."""
        if not self.on_host(block_ids):
            return None
        return self.kv, self.local(block_ids)


@dataclass(frozen=True, slots=True)
class Placed:
    """A micro-batch and where its KV is: `mode` None (device cache, device block ids), or
    "swap" / "host" (host tier, host block ids)."""

    batch: MicroBatch
    mode: Mode | None = None


def micro_batches(placed: Seq[Placed], tier: HostKVCaches, block_size: int,
                  device: torch.device, torch_decode: bool) -> list[AttentionPart]:
    """The step's micro-batches, in order (the step's tokens are their tokens one after
    another, each decodes first, then prefill chunks): device ones attend in the step's
    caches, host ones in the tier's (`HostKVCaches.caches_for`) with the tier's metadata."""
    out, start = [], 0
    tier.plan([p.batch for p in placed if p.mode == "swap"])
    for p in placed:
        rows = slice(start, start + sum(p.batch.query_lens))
        if p.mode is None:
            out.append(AttentionPart(rows, metadata(p.batch, block_size, device, torch_decode)))
        else:
            out.append(AttentionPart(rows, tier.metadata_for(p.batch, p.mode),
                                     tier.caches_for(p.batch, p.mode)))
        start = rows.stop
    return out
