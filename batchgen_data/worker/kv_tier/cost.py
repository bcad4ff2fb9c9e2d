"""Where a host-tier micro-batch attends, from measured rates: swap or host.

**swap**: copy its KV blocks into a device staging cache and run the device's own attention
there; **host**: copy q and the new k/v to the host and attend on the host cache, the host's
cores and memory bandwidth doing the work. Decodes read a long context per token (memory bound:
the host reads its own memory faster than the link delivers it); long prefill chunks do many
flops per KV byte (the device's compute wins the copy back). `measure_kv_rates` takes the rates
once, when the engine starts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from batchgen_data.worker.kv_tier.batch import MicroBatch, metadata
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
