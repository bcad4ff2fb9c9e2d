"""Attention over the paged KV cache.

The batch is flattened: the first `num_decodes` tokens are single-token decodes (one per
sequence), the rest are prefill/extend chunks of varying length whose cached prefix sits in the
paged cache. The `Attention` layer picks its implementation when it is built: the Triton
kernels on CUDA; on an fp32 CPU with its kernels, decodes in a small compiled C kernel
(`batchgen_data.kernels.cpu.attention`) that reads the paged cache directly; otherwise (and for
prefill chunks) a torch reference that gathers each sequence's blocks and runs dense attention
(`layers/attention_torch.py`).

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
from torch import nn

from batchgen_data.layers import attention_torch, kv_quant
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
        self._forward = _attention_triton if b.triton else attention_torch.attend

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
            out = attention_torch.attend(q.to(there), k.to(there), v.to(there), k_cache, v_cache, meta,
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
