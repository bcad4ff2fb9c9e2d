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

Both compute exactly what the resident path computes (the same formula on the same values), so
outputs match it (`tests/unit/offload/test_offload_kv_tier.py`). `KVTierAttention` counts the
bytes each way moves. What the engine does not do yet (the block pool's host range and the
runner's per-micro-batch dispatch) is listed in docs/offload.md, "Not done".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from batchgen_data.layers.attention import Attention, AttentionMetadata
from batchgen_data.layers.backend import LayerBackend, building
from batchgen_data.offload.kv_staging import KVStaging
from batchgen_data.offload.plan import _timed, measure_rates

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


class KVTierAttention:
    """Attention over host KV blocks for one engine: the host caches of every layer
    ([num_host_blocks, block_size, Hkv, D] each), two device staging caches of
    `staging_blocks` blocks (one swapped micro-batch of one layer each: `KVStaging`), and the
    counters."""

    def __init__(self, host_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 staging_blocks: int, device: torch.device, backend: LayerBackend) -> None:
        k0 = host_caches[0][0]
        self.host_caches = host_caches
        self.block_size, self.num_kv_heads, self.head_dim = k0.shape[1:]
        self.device, self.backend = device, backend
        self.staging = KVStaging(host_caches, staging_blocks, device)
        self._host_attn: dict[tuple[int, float], Attention] = {}
        self._host_to_device = 0  # host mode's outputs (swap mode's blocks: `staging`)
        self.bytes_to_host = 0

    @property
    def bytes_to_device(self) -> int:
        return self._host_to_device + self.staging.bytes_copied

    def plan(self, swapped: list[MicroBatch]) -> None:
        """The step's swapped micro-batches in the order each layer attends them, so that the
        next one's blocks copy while one attends (`KVStaging`)."""
        self.staging.plan([(id(b), b.tables) for b in swapped])

    def attend(self, layer: int, attn: Attention, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, batch: MicroBatch, mode: Mode) -> torch.Tensor:
        """Layer `layer`'s attention output [T, H, D] (on the device) for `batch`; its new
        k/v [T, Hkv, D] land in the host blocks."""
        if mode == "swap":
            return self._swap(layer, attn, q, k, v, batch)
        return self._on_host(layer, attn, q, k, v, batch)

    def _swap(self, layer: int, attn: Attention, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        host_k, host_v = self.host_caches[layer]
        staging, used, slot = self.staging.acquire(layer, id(batch), batch.tables)
        local = {b: i for i, b in enumerate(used)}
        dev = MicroBatch([[local[b] for b in t] for t in batch.tables], batch.seq_lens,
                         batch.query_lens)
        meta = metadata(dev, self.block_size, self.device, self.backend.torch_decode_attention)
        out = attn(q, k, v, staging, meta)
        # the new tokens' K/V were written into staging: the host blocks must hold them too
        host_slots = metadata(batch, self.block_size, torch.device("cpu"), False).slot_mapping
        for dst, src in zip((host_k, host_v), staging):
            rows = src.view(-1, *src.shape[2:]).index_select(0, meta.slot_mapping)
            dst.view(-1, *dst.shape[2:])[host_slots] = rows.to("cpu")
        self.staging.release(slot)  # after the reads above: the slot may be refilled
        self.bytes_to_host += 2 * k.numel() * k.element_size()
        return out

    def _on_host(self, layer: int, attn: Attention, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        cpu = torch.device("cpu")
        qh, kh, vh = (t.to(cpu) for t in (q, k, v))
        self.bytes_to_host += sum(t.numel() * t.element_size() for t in (q, k, v))
        meta = metadata(batch, self.block_size, cpu, torch_decode=True)
        out = self._host_attention(attn)(qh, kh, vh, self.host_caches[layer], meta)
        self._host_to_device += out.numel() * out.element_size()
        return out.to(self.device)

    def _host_attention(self, attn: Attention) -> Attention:
        """A torch-reference `Attention` on the host with `attn`'s heads and scale."""
        key = (attn.num_heads, attn.scale)
        if key not in self._host_attn:
            with building(LayerBackend(torch.device("cpu"), self.host_caches[0][0].dtype)):
                self._host_attn[key] = Attention(attn.num_heads, attn.num_kv_heads,
                                                 attn.head_dim, attn.scale)
        return self._host_attn[key]


def staging_blocks_for(max_seqs: int, max_len: int, block_size: int) -> int:
    """Staging blocks one swapped micro-batch of `max_seqs` sequences up to `max_len` needs."""
    return max_seqs * math.ceil(max_len / block_size)
