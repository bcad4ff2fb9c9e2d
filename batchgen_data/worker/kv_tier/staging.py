"""Double-buffered device staging for swapped KV micro-batches of the KV host tier.

A swapped micro-batch's KV blocks (one layer's) are gathered from the host tier and copied into
a device staging cache before its attention runs. `KVStaging` keeps two such caches and knows
the order in which a step's swapped micro-batches will be attended (`plan`: per layer, the
micro-batches in step order), so while micro-batch i attends in one cache, micro-batch i+1's
blocks (the next one of this layer, or the first of the next layer) are already being copied
into the other. On CUDA the copies run on the copier's own stream (`copy.StreamCopier`) from
page-locked gather buffers, ordered by its events: a slot is refilled only after the attention
that read it released it, and read only after its copy landed. On the CPU "device" the same code
runs with synchronous copies (`SyncCopier`): the order of work changes, not the work; a worker
thread could overlap the host gather there, but on the CPU the host and the "device" share the
cores and the memory, so there is nothing to overlap it with.
"""
from __future__ import annotations

import math

import torch

from batchgen_data.worker.offload.copy import Copier, host_buffer, make_copier

NUM_SLOTS = 2


class KVStaging:
    """Two device staging caches of `blocks` blocks (k and v each), their gather buffers, and
    the step's plan of swapped micro-batches."""

    def __init__(self, host_caches: list[tuple[torch.Tensor, torch.Tensor]], blocks: int,
                 device: torch.device) -> None:
        k0 = host_caches[0][0]
        shape = (blocks, *k0.shape[1:])  # [blocks, block_size, Hkv, D]
        self.host_caches = host_caches
        self.block_bytes = math.prod(k0.shape[1:]) * k0.element_size()
        self.slots = [tuple(torch.empty(shape, dtype=k0.dtype, device=device) for _ in "kv")
                      for _ in range(NUM_SLOTS)]
        # page-locked on CUDA, so the copies are true DMAs on the copy stream
        self._buffers = [host_buffer(2 * blocks * self.block_bytes, device)
                         for _ in range(NUM_SLOTS)]
        self.gather = [tuple(b.view(k0.dtype).view(2, *shape)) for b in self._buffers]
        self.copier: Copier = make_copier(device, NUM_SLOTS)
        self._position: dict[tuple[int, int], int] = {}  # (layer, id(batch)) -> position
        self._plan: list[tuple[int, list[int]]] = []  # per position: (layer, host blocks)
        self._staged: list[int | None] = [None] * NUM_SLOTS  # position each slot holds
        self.bytes_copied = 0
        self.prefetched = 0  # micro-batches whose blocks were copied before they were asked for

    def plan(self, tables_of_batches: list[tuple[int, list[list[int]]]]) -> None:
        """This step's swapped micro-batches, as (id of the batch, its host block tables) in
        step order; every layer attends them in that order."""
        self._position, self._plan = {}, []
        for layer in range(len(self.host_caches)):
            for key, tables in tables_of_batches:
                self._position[(layer, key)] = len(self._plan)
                self._plan.append((layer, sorted({b for t in tables for b in t})))
        self._staged = [None] * NUM_SLOTS

    def acquire(self, layer: int, key: int, tables: list[list[int]]
                ) -> tuple[tuple[torch.Tensor, ...], list[int], int]:
        """(the staging k/v caches holding `tables`' blocks of `layer`, those host block ids in
        staging order, the slot to `release` once the attention is enqueued); starts copying
        the plan's next micro-batch into the other slot."""
        pos = self._position.get((layer, key))
        if pos is None:  # not in the plan (a direct call): staged now, nothing prefetched
            used = sorted({b for t in tables for b in t})
            slot = 0
            self._stage(slot, layer, used)
            self._staged[slot] = None
        else:
            slot = pos % NUM_SLOTS
            used = self._plan[pos][1]
            if self._staged[slot] == pos:
                self.prefetched += 1
            else:
                self._stage(slot, layer, used)
                self._staged[slot] = pos
            if pos + 1 < len(self._plan):  # the next micro-batch copies while this one attends
                nxt = (pos + 1) % NUM_SLOTS
                self._stage(nxt, *self._plan[pos + 1])
                self._staged[nxt] = pos + 1
        self.copier.wait_ready(slot)
        return self.slots[slot], used, slot

    def release(self, slot: int) -> None:
        self.copier.release(slot)

    def _stage(self, slot: int, layer: int, used: list[int]) -> None:
        n = len(used)
        assert n <= self.slots[slot][0].shape[0], "a swapped micro-batch exceeds staging"
        idx = torch.tensor(used, dtype=torch.long)
        self.copier.host_wait(slot)  # the gather buffer's last copy has landed
        for dst, src, buf in zip(self.slots[slot], self.host_caches[layer], self.gather[slot]):
            torch.index_select(src, 0, idx, out=buf[:n])
            self.copier.copy(slot, dst[:n], buf[:n])
        self.bytes_copied += 2 * n * self.block_bytes
