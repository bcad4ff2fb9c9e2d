"""The torch path of paged attention (`layers/attention.py` picks it where no kernel runs):
decodes over each sequence's gathered blocks under a mask, prefill chunks over their gathered
cached prefix (its window only, for a windowed layer), attention sinks as one more key of
score 0 whose bias is the sink and whose value is zero, logit soft-capping in an explicit
softmax. An FP8 cache is read dequantized (`layers/kv_quant.py`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from batchgen_data.layers import kv_quant


def attend(q, k, v, k_cache, v_cache, meta, scale, c_decode, kvs, window=None,  # type: ignore[no-untyped-def]
           sinks=None, softcap=None):
    """Writes the new tokens' K/V into the paged cache and attends (the decodes in the C
    kernel when `c_decode`), returning [T, H, D]; the arguments are `Attention`'s."""
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
        outs.append(decode(q[:nd], k_cache, v_cache, meta, scale, kvs, window, sinks,
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
        outs.append(prefill_one(qs, ks, vs, scale, window, sinks, softcap))
        start += qlen
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def prefill_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
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
        o = sdpa(qt, kt, vt, mask, scale, sink, gqa=True, softcap=softcap)
    return o[0].transpose(0, 1)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
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
    """`sdpa` with each score s bent to softcap * tanh(s / softcap), in float32."""
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


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: Any, scale: float,
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
    o = sdpa(q.view(nd, num_kv, group, head_dim), keys.transpose(1, 2), vals.transpose(1, 2),
              mask, scale, sink, softcap=softcap)
    return o.reshape(nd, -1, head_dim)  # [B, H, D]
