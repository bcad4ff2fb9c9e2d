"""Attention for a micro-batch of sequences whose KV lives in host memory (issue 16).

Module-based batching (FlexGen's block schedule, MoE-Gen's module batching) runs each streamed
layer once over more sequences than the device KV cache holds: attention runs per micro-batch,
and a micro-batch whose KV blocks sit in the host tier is served one of two ways, chosen per
micro-batch by `choose_mode` from measured rates:

* **swap**: copy its KV blocks into a small device staging cache (double-buffered: the next
  swapped micro-batch's blocks copy while this one attends, `kv_staging.py`), run the device's
  own attention kernel there, and copy the new tokens' K/V (a few rows) back to the host blocks;
* **host**: copy q and the new k/v to the host, run the torch attention on the host cache (the
  host's cores and memory bandwidth do the work), and copy the output back.

The tier stays behind the KV cache's interface: a host micro-batch is an `AttentionPart` whose
caches are `HostTierCaches` (per layer: the staging cache, or the host cache itself, which
`Attention` attends on its own device) with the matching metadata; no layer or model takes a
callback. Both compute exactly what the resident path computes (the same formula on the same
values), so outputs match it (`tests/unit/worker/offload/test_offload_kv_tier.py`). `HostKVCaches`
counts the bytes each way moves. What the engine does not do yet (the block pool's host range and the
runner's per-micro-batch dispatch) is listed in docs/offload.md, "Not done".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from batchgen_data.layers.attention import AttentionMetadata
from batchgen_data.layers.backend import LayerBackend
from batchgen_data.worker.offload.kv_staging import KVStaging
from batchgen_data.worker.offload.plan import _timed, measure_rates

Mode = Literal["swap", "host"]


@dataclass(frozen=True, slots=True)
class KVRates:
    """Measured rates (`measure_kv_rates`) the placement choice weighs."""

    copy_bytes_per_s: float  # host <-> device copies
    device_flops_per_s: float
    device_read_bytes_per_s: float  # device memory read rate
    host_flops_per_s: float
    host_read_bytes_per_s: float
    # the fixed cost of one micro-batch per layer (its metadata, a gather, a copy, a sync),
    # which sizes micro-batches (`plan.micro_batch_seqs`); 20 us where not measured
    call_s: float = 2e-5


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch in host block ids: decodes first, then prefill chunks (the runner's
    layout). `tables[i]` are sequence i's host KV blocks; `seq_lens` its KV length after this
    step; `query_lens` its new tokens."""

    tables: list[list[int]]
    seq_lens: list[int]
    query_lens: list[int]

    @property
    def num_decodes(self) -> int:
        return sum(q == 1 for q in self.query_lens)

    def work(self, num_heads: int, num_kv_heads: int, head_dim: int, itemsize: int
             ) -> tuple[int, int, int]:
        """(KV bytes read, q/k/v/out bytes, flops) of one layer's attention over this batch."""
        kv = sum(self.seq_lens) * 2 * num_kv_heads * head_dim * itemsize
        tokens = sum(self.query_lens)
        io = tokens * (2 * num_heads + 2 * num_kv_heads) * head_dim * itemsize
        # QK^T and PV: 2 flops per multiply-add each, every new token against its whole context
        flops = sum(4 * q * s * num_heads * head_dim
                    for q, s in zip(self.query_lens, self.seq_lens))
        return kv, io, flops


def costs(kv_bytes: int, io_bytes: int, flops: int, rates: KVRates) -> dict[Mode, float]:
    """Seconds each way takes: copies over the link, then the attention itself, bounded by
    the slower of its compute and its reading of the KV."""
    r = rates
    return {
        "swap": (kv_bytes + io_bytes) / r.copy_bytes_per_s
        + max(flops / r.device_flops_per_s, kv_bytes / r.device_read_bytes_per_s),
        "host": io_bytes / r.copy_bytes_per_s
        + max(flops / r.host_flops_per_s, kv_bytes / r.host_read_bytes_per_s),
    }


def swap_exposed_s(batch: MicroBatch, num_heads: int, num_kv_heads: int, head_dim: int,
                   itemsize: int, rates: KVRates) -> float:
    """Seconds per sequence of `batch` that double-buffered swapping leaves exposed: of the
    copy and the attention, the smaller stage (the larger one hides the other but for the
    pipeline's fill), averaged over the batch's sequences."""
    kv, io, flops = batch.work(num_heads, num_kv_heads, head_dim, itemsize)
    r = rates
    copy = (kv + io) / r.copy_bytes_per_s
    compute = max(flops / r.device_flops_per_s, kv / r.device_read_bytes_per_s)
    return min(copy, compute) / len(batch.tables)


def choose_mode(batch: MicroBatch, num_heads: int, num_kv_heads: int, head_dim: int,
                itemsize: int, rates: KVRates) -> Mode:
    """The cheaper way to attend over `batch`'s host KV. Decodes read a long context per token
    (memory bound): the host reads its own memory faster than the link delivers it. Long
    prefill chunks do many flops per KV byte: the device's compute wins the copy back."""
    c = costs(*batch.work(num_heads, num_kv_heads, head_dim, itemsize), rates)
    return "host" if c["host"] <= c["swap"] else "swap"


def measure_kv_rates(device: torch.device, dtype: torch.dtype, nbytes: int = 32 << 20,
                     reps: int = 3) -> KVRates:
    """Copy bandwidth, matmul rate and memory read rate of `device` and of the host."""
    dev = measure_rates(device, dtype, nbytes, reps)
    cpu = torch.device("cpu")
    host = dev if device.type == "cpu" else measure_rates(cpu, dtype, nbytes, reps)

    def read_rate(d: torch.device) -> float:
        src = torch.empty(nbytes, dtype=torch.uint8, device=d)
        dst = torch.empty_like(src)
        sync = (lambda: torch.cuda.synchronize(d)) if d.type == "cuda" else (lambda: None)
        return 2 * nbytes / _timed(lambda: dst.copy_(src), reps, sync)  # read + write

    host_read = read_rate(cpu)
    dev_read = host_read if device.type == "cpu" else read_rate(device)
    return KVRates(dev.copy_bytes_per_s, dev.flops_per_s, dev_read, host.flops_per_s, host_read,
                   _call_s(device, reps))


def _call_s(device: torch.device, reps: int) -> float:
    """The fixed work of one micro-batch of one layer, timed on a one-token batch: its
    metadata on `device`, a gather of one host row and its copy to the device, a sync."""
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    one = MicroBatch([[0]], [1], [1])
    src = torch.randn(4, 64)
    idx = torch.zeros(1, dtype=torch.long)
    dst = torch.empty(1, 64, device=device)

    def once() -> None:
        metadata(one, 1, device, torch_decode=False)
        dst.copy_(src.index_select(0, idx))

    return _timed(once, reps, sync)


def metadata(batch: MicroBatch, block_size: int, device: torch.device,
             torch_decode: bool) -> AttentionMetadata:
    """The attention metadata of `batch` with its block ids as given, on `device`."""
    slots: list[int] = []
    for table, s, q in zip(batch.tables, batch.seq_lens, batch.query_lens):
        slots.extend(table[p // block_size] * block_size + p % block_size
                     for p in range(s - q, s))
    nd = batch.num_decodes
    width = max(map(len, batch.tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in batch.tables], dtype=torch.int32)
    prefill_q = batch.query_lens[nd:]
    cu = [0]
    for q in prefill_q:
        cu.append(cu[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device), num_decodes=nd,
        block_tables=table.to(device), seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32,
                                                             device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens_host=list(batch.seq_lens), query_lens_host=list(batch.query_lens),
        max_decode_len=max(batch.seq_lens[:nd], default=0), max_prefill_len=max(prefill_q,
                                                                                default=0))
    if nd and torch_decode:  # the torch decode path gathers whole blocks (model_runner.py)
        nblk = -(-meta.max_decode_len // block_size)
        mask = (torch.arange(nblk * block_size).unsqueeze(0)
                < torch.tensor(batch.seq_lens[:nd]).unsqueeze(1))
        meta.decode_blocks = table[:nd, :nblk].reshape(-1).long().to(device)
        meta.decode_mask = mask[:, None, None, :].to(device)
    return meta


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
