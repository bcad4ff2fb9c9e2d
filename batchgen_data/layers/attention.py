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

A layer may attend over a sliding window (`sliding_window`: each query sees the last that many
positions, itself included; Mistral, Gemma's local layers, gpt-oss) and may add attention sinks
(`sinks`: a learned logit per query head in every softmax's denominator, gpt-oss). Every path
takes both: the kernels start at the window's first token, the torch path gathers a prefill's
window only and masks a decode's, and adds a sink as one more key of score 0 whose bias is the
sink and whose value is zero. Logit soft-capping (`softcap`, Gemma 2: each score s becomes
cap * tanh(s / cap)) runs in the kernels and, on the torch path, in an explicit softmax.

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
    one a micro-batch's caches are read at. `sliding_window`: the positions each query sees
    (None: all); `sinks`: the layer holds one sink logit per query head (`self.sinks`, filled by
    the loader)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 layer_idx: int, sliding_window: int | None = None, sinks: bool = False,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        if sliding_window is not None and (not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window must be None or an int >= 1, got "
                             f"{sliding_window!r}")
        self.sliding_window = sliding_window
        self.sinks = (nn.Parameter(torch.zeros(num_heads, dtype=torch.float32),
                                   requires_grad=False) if sinks else None)
        self.softcap = float(softcap) if softcap else None
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
            sinks = None if self.sinks is None else self.sinks.to(there)
            out = _attention_torch(q.to(there), k.to(there), v.to(there), k_cache, v_cache, meta,
                                   self.scale, self.c_decode and there.type == "cpu",
                                   self.kv_scales, self.sliding_window, sinks, self.softcap)
            return out.to(q.device)
        return self._forward(q, k, v, k_cache, v_cache, meta, self.scale, self.c_decode,
                             self.kv_scales, self.sliding_window, self.sinks, self.softcap)


def _attention_triton(q, k, v, k_cache, v_cache, meta, scale, c_decode, kvs, window=None,  # type: ignore[no-untyped-def]
                      sinks=None, softcap=None):
    from batchgen_data.kernels import paged_decode_attention, paged_prefill_attention, write_kv_cache

    # kvs: the FP8 scales, ignored by the kernels for a cache of q's dtype
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, kvs.k, kvs.v)
    nd = meta.num_decodes
    out = torch.empty_like(q)
    if nd:
        out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                          meta.seq_lens[:nd], scale, k_scale=kvs.k,
                                          v_scale=kvs.v, sliding_window=window, sinks=sinks,
                                          softcap=softcap)
    if q.shape[0] > nd:
        out[nd:] = paged_prefill_attention(q[nd:], k_cache, v_cache, meta.block_tables[nd:],
                                           meta.cu_seqlens_q, meta.seq_lens[nd:], scale,
                                           max_seqlen_q=meta.max_prefill_len, k_scale=kvs.k,
                                           v_scale=kvs.v, sliding_window=window, sinks=sinks,
                                           softcap=softcap)
    return out


def _attention_torch(q, k, v, k_cache, v_cache, meta, scale, c_decode, kvs, window=None,  # type: ignore[no-untyped-def]
                     sinks=None, softcap=None):
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
                                               meta.seq_lens[:nd], scale, kvs.k, kvs.v,
                                               window, sinks, softcap))
    elif nd:
        outs.append(_decode_torch(q[:nd], k_cache, v_cache, meta, scale, kvs, window, sinks,
                                  softcap))
    start = nd
    bs = k_cache.shape[1]
    for i, (qlen, slen) in enumerate(zip(meta.query_lens_host[nd:], meta.seq_lens_host[nd:])):
        qs = q[start:start + qlen]
        if qlen == slen:  # no cached prefix: attend to the fresh K/V directly
            ks, vs = k[start:start + qlen], v[start:start + qlen]
        else:  # the cached prefix from the first token the chunk's first query sees
            first = max(0, slen - qlen + 1 - window) if window else 0
            b0, nblk = first // bs, -(-slen // bs)
            blocks = meta.block_tables[nd + i, b0:nblk].long()
            ks = k_cache[blocks].view(-1, num_kv, head_dim)[first - b0 * bs:slen - b0 * bs]
            vs = v_cache[blocks].view(-1, num_kv, head_dim)[first - b0 * bs:slen - b0 * bs]
        if fp8:
            ks = kv_quant.dequantize(ks, kvs.k, q.dtype)
            vs = kv_quant.dequantize(vs, kvs.v, q.dtype)
        outs.append(_prefill_one(qs, ks, vs, scale, window, sinks, softcap))
        start += qlen
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _prefill_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 window: int | None = None, sinks: torch.Tensor | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    # q [Q, H, D], k/v [S, Hkv, D] with the Q new tokens at the end of the S
    # 4-D inputs (a batch of one): on the CPU only those reach torch's fused flash kernel; 3-D
    # ones take the slower unfused math path.
    qlen, slen = q.shape[0], k.shape[0]
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if qlen == slen and not window and sinks is None and not softcap:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:
        rows = torch.arange(qlen, device=q.device).unsqueeze(1) + (slen - qlen)
        cols = torch.arange(slen, device=q.device).unsqueeze(0)
        mask = cols <= rows  # [Q, S]
        if window:
            mask &= cols > rows - window
        sink = None if sinks is None else sinks.view(1, -1, 1, 1)
        o = _sdpa(qt, kt, vt, mask, scale, sink, gqa=True, softcap=softcap)
    return o[0].transpose(0, 1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
          sink: torch.Tensor | None, gqa: bool = False, softcap: float | None = None
          ) -> torch.Tensor:
    """SDPA of q [B, Hq, Q, D] over k/v [B, Hk, S, D] under the boolean `mask` (True = attend),
    with `sink` (per query row, broadcastable to [B, Hq, Q, 1]) as one more key: a zero key
    and value whose score bias is the sink, so the softmax's denominator gains exp(sink).
    `softcap`: SDPA cannot bend its scores, so the softmax is spelled out."""
    if softcap:
        return _softcapped(q, k, v, mask, scale, sink, softcap)
    if sink is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)
    zero = k.new_zeros(k.shape[:2] + (1, k.shape[3]))
    k, v = torch.cat([k, zero], 2), torch.cat([v, zero], 2)
    shape = (q.shape[0], q.shape[1], q.shape[2])
    bias = torch.zeros(shape + (mask.shape[-1],), dtype=q.dtype, device=q.device)
    bias = bias.masked_fill(~mask, float("-inf"))
    bias = torch.cat([bias, sink.to(q.dtype).expand(shape + (1,))], -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=gqa)


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                scale: float, sink: torch.Tensor | None, softcap: float) -> torch.Tensor:
    """`_sdpa` with each score s bent to softcap * tanh(s / softcap), in float32."""
    if k.shape[1] != q.shape[1]:  # GQA: each KV head serves its group of query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sink is not None:
        shape = scores.shape[:-1] + (1,)
        scores = torch.cat([scores, sink.float().expand(shape)], -1)
    probs = torch.softmax(scores, -1)
    if sink is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def _decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float,
                  kvs: kv_quant.KVScales = kv_quant.KVScales(), window: int | None = None,
                  sinks: torch.Tensor | None = None, softcap: float | None = None
                  ) -> torch.Tensor:
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
    mask = meta.decode_mask
    if window:  # the gathered blocks also hold positions before the window
        pos = torch.arange(mask.shape[-1], device=mask.device)
        lo = meta.seq_lens[:nd].view(nd, 1, 1, 1) - window
        mask = mask & (pos >= lo)
    sink = None if sinks is None else sinks.view(1, num_kv, group, 1)
    o = _sdpa(q.view(nd, num_kv, group, head_dim), keys.transpose(1, 2), vals.transpose(1, 2),
              mask, scale, sink, softcap=softcap)
    return o.reshape(nd, -1, head_dim)  # [B, H, D]
