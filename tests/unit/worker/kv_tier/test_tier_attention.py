"""Attention for a micro-batch whose KV sits in host memory (issue 16, module-based batching):
both ways (swap into device staging, attend on the host) give the resident attention's output
and leave the new tokens' K/V in the host blocks; the placement choice follows the cost model."""
from __future__ import annotations

import pytest
import torch

from batchgen_data.layers.attention import Attention
from batchgen_data.layers.backend import LayerBackend, building
from batchgen_data.worker.kv_tier.batch import MicroBatch, metadata
from batchgen_data.worker.kv_tier.caches import HostKVCaches
from batchgen_data.worker.kv_tier.cost import KVRates, choose_mode, costs, measure_kv_rates

BLOCK = 4
# (query heads, KV heads, head dim): a tiny Llama's attention and a Qwen3-MoE-like one (more
# query heads per KV head, wider heads)
SHAPES = {"dense": (4, 2, 16), "moe": (8, 2, 32)}
# two decodes, a prefill chunk over a cached prefix, a fresh prompt
SEQ_LENS, QUERY_LENS = [7, 12, 10, 5], [1, 1, 4, 5]


def _resident_tables() -> list[list[int]]:
    tables, nxt = [], 0
    for s in SEQ_LENS:
        n = -(-s // BLOCK)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    return tables


def _setup(shape: tuple[int, int, int], cpu_kernels: bool):  # type: ignore[no-untyped-def]
    heads, kv_heads, dim = shape
    g = torch.Generator().manual_seed(heads * dim)
    tables = _resident_tables()
    num_blocks = sum(map(len, tables)) + 2
    dev_k = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    dev_v = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    # the host tier holds the same blocks under other ids (and a few unrelated ones)
    perm = torch.randperm(num_blocks + 3, generator=g)[:num_blocks].tolist()
    host_k = torch.randn(num_blocks + 3, BLOCK, kv_heads, dim, generator=g)
    host_v = torch.randn(num_blocks + 3, BLOCK, kv_heads, dim, generator=g)
    for b, h in enumerate(perm):
        host_k[h], host_v[h] = dev_k[b], dev_v[b]
    tokens = sum(QUERY_LENS)
    q = torch.randn(tokens, heads, dim, generator=g)
    k = torch.randn(tokens, kv_heads, dim, generator=g)
    v = torch.randn(tokens, kv_heads, dim, generator=g)
    backend = LayerBackend.choose(torch.device("cpu"), torch.float32, cpu_kernels, dim)
    with building(backend):
        attn = Attention(heads, kv_heads, dim, dim ** -0.5, layer_idx=0)
    resident = MicroBatch(tables, SEQ_LENS, QUERY_LENS)
    host = MicroBatch([[perm[b] for b in t] for t in tables], SEQ_LENS, QUERY_LENS)
    return attn, backend, (dev_k, dev_v), (host_k, host_v), resident, host, (q, k, v)


@pytest.mark.parametrize("cpu_kernels", [False, True])
@pytest.mark.parametrize("mode", ["swap", "host"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_tier_attention_matches_resident(name: str, mode: str, cpu_kernels: bool) -> None:
    attn, backend, dev, host, resident, in_host, (q, k, v) = _setup(SHAPES[name], cpu_kernels)
    meta = metadata(resident, BLOCK, torch.device("cpu"), backend.torch_decode_attention)
    want = attn(q, k, v, dev, meta)
    tier = HostKVCaches([host], staging_blocks=16, device=torch.device("cpu"), backend=backend,
                        num_heads=q.shape[1])
    # the layer sees caches and metadata only: the tier's, for a host micro-batch
    caches = tier.caches_for(in_host, mode)  # type: ignore[arg-type]
    got = attn(q, k, v, caches[0], tier.metadata_for(in_host, mode))  # type: ignore[arg-type]
    tier.flush()  # the swapped rows reach the host blocks
    # on the CPU "device" the host caches are on q's device: the same kernel, the same values
    assert torch.equal(got, want)
    # the new tokens' K/V are in the host blocks, where the resident path wrote them
    host_slots = metadata(in_host, BLOCK, torch.device("cpu"), False).slot_mapping
    for cache, res in zip(host, dev):
        flat, res_flat = cache.view(-1, *cache.shape[2:]), res.view(-1, *res.shape[2:])
        assert torch.equal(flat[host_slots], res_flat[meta.slot_mapping])
    moved = sum(t.numel() * 4 for t in (q, k, v))
    if mode == "swap":
        blocks = sum(map(len, in_host.tables))
        assert tier.bytes_to_device == 2 * blocks * BLOCK * k.shape[1] * k.shape[2] * 4
        assert tier.bytes_to_host == 2 * k.numel() * 4
    else:
        assert tier.bytes_to_host == moved and tier.bytes_to_device == q.numel() * 4


def _rates(copy: float, dev_flops: float, host_flops: float, host_read: float) -> KVRates:
    return KVRates(copy, dev_flops, device_read_bytes_per_s=4e12, host_flops_per_s=host_flops,
                   host_read_bytes_per_s=host_read)


def test_choice_follows_the_cost_model() -> None:
    # a GPU-like machine: a 50 GB/s link, fast device compute, 200 GB/s host memory
    gpu = _rates(50e9, 700e12, 2e12, 200e9)
    decodes = MicroBatch([[0] * 64] * 32, [1024] * 32, [1] * 32)
    prefill = MicroBatch([[0] * 64] * 4, [1024] * 4, [1024] * 4)
    shape = (32, 8, 128, 2)
    assert choose_mode(decodes, *shape, gpu) == "host"  # memory bound: host reads faster
    assert choose_mode(prefill, *shape, gpu) == "swap"  # compute bound: the device wins
    c = costs(*prefill.work(*shape), gpu)
    assert c["swap"] < c["host"]
    # a host slower to read its memory than the link: swapping decodes pays
    assert choose_mode(decodes, *shape, _rates(50e9, 700e12, 2e12, 20e9)) == "swap"


def test_measured_rates_on_the_cpu_device_prefer_the_host() -> None:
    rates = measure_kv_rates(torch.device("cpu"), torch.float32, nbytes=4 << 20, reps=1)
    assert min(rates.copy_bytes_per_s, rates.device_flops_per_s,
               rates.host_read_bytes_per_s) > 0
    # host and device are one memory: a swap only adds a copy
    batch = MicroBatch([[0, 1]], [8], [1])
    assert choose_mode(batch, 4, 2, 16, 4, rates) == "host"
