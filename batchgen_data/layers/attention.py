"""Attention over the paged KV cache.

The batch is flattened: the first `num_decodes` tokens are single-token decodes (one per
sequence), the rest are prefill/extend chunks of varying length whose cached prefix sits in the
paged cache. The `Attention` layer picks its implementation when it is built: the Triton
kernels on CUDA; on an fp32 CPU with its kernels, decodes in a small compiled C kernel
(`batchgen_data.kernels.cpu.attention`) that reads the paged cache directly; otherwise (and for
prefill chunks) a torch reference that gathers each sequence's blocks and runs dense attention.

An FP8 cache (float8_e4m3fn, `kv_cache_dtype="fp8"`; `layers/kv_quant.py`) is written as e4m3
codes with this layer's `kv_scales` and read dequantized by every path: the Triton kernels and
the C decode kernel widen the codes in registers, the torch path dequantizes what it gathers,
and a prefill chunk without a cached prefix attends over its own K/V rounded through e4m3 too,
so every path attends over the values the cache holds.

A step may also be attended in micro-batches (`AttentionMetadata.micro_batches`, laid out by the
runner): runs of its sequences attended one after another, each with its own metadata and, where
its KV is not in the step's cache (the KV host tier), its own caches, one per layer. The layer
picks its micro-batch's cache by its index (`layer_idx`); the model above it sees one metadata
per step and never learns where a micro-batch's KV is.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from torch import nn

from batchgen_data.layers import kv_quant
from batchgen_data.layers.backend import current


KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (k_cache, v_cache)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    num_decodes: int  # the first num_decodes tokens are decodes, one per sequence
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, decodes first
    seq_lens: torch.Tensor  # [num_seqs] int32: KV length after this step
    cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32: prefill token offsets (from num_decodes)
    # host-side copies for the CPU reference path (no device sync needed)
    seq_lens_host: list[int]
    query_lens_host: list[int]
    max_decode_len: int
    max_prefill_len: int  # longest prefill chunk (spares the kernel a device sync)
    # torch path only, built once per step and shared by every layer:
    decode_blocks: torch.Tensor | None = None  # [num_decodes * nblk] cache blocks, row-major
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, nblk * block_size] True = attend
    # the step attended as micro-batches, one after another in row order (None: as one batch);
    # the fields above then belong to no batch and are not read (`in_micro_batches`)
    micro_batches: list[AttentionPart] | None = None

    @classmethod
    def in_micro_batches(cls, parts: Sequence[AttentionPart]) -> AttentionMetadata:
        """A step attended as `parts`, whose token rows follow one another from row 0. Its own
        batch fields describe an empty batch: every attention goes by the parts."""
        device = parts[0].meta.slot_mapping.device
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        return cls(slot_mapping=empty.long(), num_decodes=0, block_tables=empty.view(0, 0),
                   seq_lens=empty, cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=device),
                   seq_lens_host=[], query_lens_host=[], max_decode_len=0, max_prefill_len=0,
                   micro_batches=list(parts))


class AttentionPart(NamedTuple):
    """One micro-batch of a step: its token rows, its attention metadata, and the KV caches its
    sequences' KV is in, one per layer (None: the step's own caches). `Attention` reads
    ``caches[layer_idx]`` just before it attends this micro-batch, after the micro-batch before
    it has attended (a host-tier cache is staged then); a cache on another device than the
    step's tensors is attended on that device."""

    rows: slice
    meta: AttentionMetadata
    caches: Sequence[KVCache] | None = None


# (layer, q, k, v, kv_cache, meta) -> [T, H, D]: what an Attention call becomes inside
# `split_at_attention` (the cut points of piecewise CUDA graphs, worker/fast_paths/)
SplitHook = Callable[["Attention", torch.Tensor, torch.Tensor, torch.Tensor,
                      "tuple[torch.Tensor, torch.Tensor]", AttentionMetadata], torch.Tensor]
_split: ContextVar[SplitHook | None] = ContextVar("attention_split", default=None)


@contextlib.contextmanager
def split_at_attention(hook: SplitHook) -> Iterator[None]:
    """Within the block, every `Attention` call is handed to `hook` instead of attending: a
    forward run there is cut into the pieces between its attention calls (the model code does
    not know)."""
    token = _split.set(hook)
    try:
        yield
    finally:
        _split.reset(token)


class Attention(nn.Module):
    """Writes the new tokens' K/V into the paged cache and attends over it, where the cache is:
    a cache on another device than q (a micro-batch's KV held in host memory) is written and
    attended on its own device by the torch path, with its metadata on that device, and the
    output comes back to q's device. `layer_idx` is the layer's index in the model's stack: the
    one a micro-batch's caches are read at."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        # an FP8 cache's scales (the checkpoint's, else 1.0; models/loader.py sets them)
        self.kv_scales = kv_quant.KVScales()
        b = current()
        self.c_decode = b.c_attention
        self._forward = _attention_triton if b.triton else _attention_torch

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (new tokens); caches [num_blocks, block_size, Hkv, D].
        Returns [T, H, D]."""
        hook = _split.get()
        if hook is not None:
            return hook(self, q, k, v, kv_cache, meta)
        return self.attend(q, k, v, kv_cache, meta)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
               ) -> torch.Tensor:
        """`forward` itself, whatever the split: writes the K/V and attends, per micro-batch
        when the step has them."""
        parts = meta.micro_batches
        if parts is None:
            return self._attend_batch(q, k, v, kv_cache, meta)
        # each micro-batch's cache is asked for only when it attends (staged then, after the
        # micro-batch before it: the order the KV host tier's double buffer relies on)
        return torch.cat([self._attend_batch(q[p.rows], k[p.rows], v[p.rows],
                                             kv_cache if p.caches is None
                                             else p.caches[self.layer_idx], p.meta)
                          for p in parts])

    def _attend_batch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                      ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        if k_cache.device != q.device:
            there = k_cache.device
            out = _attention_torch(q.to(there), k.to(there), v.to(there), k_cache, v_cache, meta,
                                   self.scale, self.c_decode and there.type == "cpu",
                                   self.kv_scales)
            return out.to(q.device)
        return self._forward(q, k, v, k_cache, v_cache, meta, self.scale, self.c_decode,
                             self.kv_scales)


def _attention_triton(q, k, v, k_cache, v_cache, meta, scale, c_decode, kvs):  # type: ignore[no-untyped-def]
    from batchgen_data.kernels import paged_decode_attention, paged_prefill_attention, write_kv_cache

    # kvs: the FP8 scales, ignored by the kernels for a cache of q's dtype
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, kvs.k, kvs.v)
    nd = meta.num_decodes
    out = torch.empty_like(q)
    if nd:
        out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                          meta.seq_lens[:nd], scale, k_scale=kvs.k,
                                          v_scale=kvs.v)
    if q.shape[0] > nd:
        out[nd:] = paged_prefill_attention(q[nd:], k_cache, v_cache, meta.block_tables[nd:],
                                           meta.cu_seqlens_q, meta.seq_lens[nd:], scale,
                                           max_seqlen_q=meta.max_prefill_len, k_scale=kvs.k,
                                           v_scale=kvs.v)
    return out


def _attention_torch(q, k, v, k_cache, v_cache, meta, scale, c_decode, kvs):  # type: ignore[no-untyped-def]
    num_kv = k_cache.shape[2]
    head_dim = k_cache.shape[3]
    fp8 = kv_quant.is_fp8(k_cache)
    if fp8:  # the codes; what every read below gives back is code * scale
        k, v = kv_quant.quantize(k, kvs.inv_k), kv_quant.quantize(v, kvs.inv_v)
    k_cache.view(-1, num_kv, head_dim)[meta.slot_mapping] = k
    v_cache.view(-1, num_kv, head_dim)[meta.slot_mapping] = v
    nd = meta.num_decodes
    outs = []
    if nd and c_decode:
        from batchgen_data.kernels.cpu import attention as cpu_attention
        outs.append(cpu_attention.paged_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                               meta.seq_lens[:nd], scale, kvs.k, kvs.v))
    elif nd:
        outs.append(_decode_torch(q[:nd], k_cache, v_cache, meta, scale, kvs))
    start = nd
    for i, (qlen, slen) in enumerate(zip(meta.query_lens_host[nd:], meta.seq_lens_host[nd:])):
        qs = q[start:start + qlen]
        if qlen == slen:  # no cached prefix: attend to the fresh K/V directly
            ks, vs = k[start:start + qlen], v[start:start + qlen]
        else:
            nblk = -(-slen // k_cache.shape[1])
            blocks = meta.block_tables[nd + i, :nblk].long()
            ks = k_cache[blocks].view(-1, num_kv, head_dim)[:slen]
            vs = v_cache[blocks].view(-1, num_kv, head_dim)[:slen]
        if fp8:
            ks = kv_quant.dequantize(ks, kvs.k, q.dtype)
            vs = kv_quant.dequantize(vs, kvs.v, q.dtype)
        outs.append(_prefill_one(qs, ks, vs, scale))
        start += qlen
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _prefill_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q [Q, H, D], k/v [S, Hkv, D] with the Q new tokens at the end of the S
    # 4-D inputs (a batch of one): on the CPU only those reach torch's fused flash kernel; 3-D
    # ones take the slower unfused math path.
    qlen, slen = q.shape[0], k.shape[0]
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if qlen == slen:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:
        rows = torch.arange(qlen, device=q.device).unsqueeze(1) + (slen - qlen)
        mask = torch.arange(slen, device=q.device).unsqueeze(0) <= rows  # [Q, S]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
    return o[0].transpose(0, 1)


def _decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float,
                  kvs: kv_quant.KVScales = kv_quant.KVScales()) -> torch.Tensor:
    # q [B, H, D]. Gather each sequence's KV blocks (one index_select of whole blocks) and let
    # SDPA read them strided: this moves KV once instead of three times.
    nd, num_kv, head_dim = meta.num_decodes, k_cache.shape[2], k_cache.shape[3]
    blocks = meta.decode_blocks
    keys = k_cache.index_select(0, blocks).view(nd, -1, num_kv, head_dim)
    vals = v_cache.index_select(0, blocks).view(nd, -1, num_kv, head_dim)
    if kv_quant.is_fp8(k_cache):
        keys = kv_quant.dequantize(keys, kvs.k, q.dtype)
        vals = kv_quant.dequantize(vals, kvs.v, q.dtype)
    # The query heads that share a KV head attend to the same keys under the same mask, so they
    # go in as that KV head's "query rows": plain attention, no GQA expansion of K/V (which
    # enable_gqa would do on the CPU).
    group = q.shape[1] // num_kv
    o = F.scaled_dot_product_attention(q.view(nd, num_kv, group, head_dim), keys.transpose(1, 2),
                                       vals.transpose(1, 2), attn_mask=meta.decode_mask,
                                       scale=scale)
    return o.reshape(nd, -1, head_dim)  # [B, H, D]
