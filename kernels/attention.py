"""Attention over the paged KV cache: decode (one new token per sequence) and varlen prefill.

Both kernels walk a sequence's KV in tiles of ``BLOCK_N`` tokens, turning each token position into
a cache slot through ``block_tables`` (so the tile size is independent of the page size), and
keep a flash-attention online softmax in float32 (log2 domain, ``exp2``).

* Decode (flash-decoding): one program owns one (sequence, kv head, split). All ``G = H / Hkv``
  query heads sharing that kv head are processed together as the rows of a ``[G, D] @ [D, N]``
  dot, so each KV tile is read once per kv head group, not once per query head. Long contexts are
  cut into ``num_splits`` token ranges processed in parallel; a second small kernel merges the
  partial (max, sum, acc) triples. With one split the first kernel writes the output directly.
* Prefill: one program owns a few new tokens of one sequence for the query heads of one kv head
  (the whole group, or a block of it when the group alone fills a tile: MLA's 128). Its q tile's
  rows are (token, head) pairs, heads fastest, so each KV tile is read once for all of them, as
  in decode. The new tokens are the last ``q_len`` of ``seq_len`` (cached prefix first), with a
  causal mask. Tile sizes: `_attention_checks.prefill_tiles`.

A sliding window (``sliding_window``: each query sees the last that many positions, itself
included) starts every loop at the window's first token, so a windowed layer reads only its
window's tiles; a longer prefill chunk masks per row inside the tiles. Logit soft-capping
(``softcap``, Gemma 2) bends each score through cap * tanh(score / cap) before the softmax. Attention sinks
(``sinks``: one learned logit per query head, gpt-oss) join each softmax's denominator at the
end (`_with_sink`), in the merge kernel when decode was split.

An FP8 cache (float8_e4m3fn codes, per-tensor ``k_scale`` / ``v_scale``:
`batchgen_data/layers/kv_quant.py`) is read as bytes and widened in registers: the 7 magnitude
bits shifted into an fp16's exponent and mantissa give ``code / 256`` exactly (subnormals too,
on any GPU and under the interpreter), then q's dtype for the dots. ``256 * k_scale`` folds into
the score scale and ``256 * v_scale`` into the output, so no dequantized tile is ever rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_device, check_last_dim_contiguous, check_tensor, tile
from ._attention_checks import (check_attention_args, pick_num_splits, prefill_tiles,
                                window_and_sinks)

_LOG2E = 1.4426950408889634
_FP8_UNIT = 256.0  # `_e4m3_over_256` gives code / 256


@triton.jit
def _e4m3_over_256(b):
    """float8_e4m3fn bit patterns (int32) -> their values / 256 as fp16, exactly: sign to bit
    15, the 4 exponent and 3 mantissa bits to fp16's (exponent bias 15 = 7 + 8)."""
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _load_kv(ptr, off, mask, like, FP8: tl.constexpr):
    """A K or V tile in the dtype of `like` (q): codes / 256 for an FP8 cache (bytes)."""
    if FP8:  # (one return: the compiler would type both branches' returns)
        x = _e4m3_over_256(tl.load(ptr + off, mask=mask, other=0).to(tl.int32)).to(like.dtype)
    else:
        x = tl.load(ptr + off, mask=mask, other=0.0)
    return x


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, bt_row_ptr, offs_n, n_mask, s_mask, m_i, l_i, acc,
                 kv_head, num_kv_heads, head_dim, block_size, scale_log2, cap_log2,
                 BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
                 SOFTCAP: tl.constexpr):
    """One online-softmax step: q [M, BLOCK_D] against KV tokens ``offs_n`` [N]. SOFTCAP: each
    score s becomes cap * tanh(s / cap) (Gemma 2; `cap_log2` is cap in the log2 domain)."""
    dims = tl.arange(0, BLOCK_D)
    block_id = tl.load(bt_row_ptr + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
    slot = block_id * block_size + offs_n % block_size  # [N]
    kv_off = slot[:, None] * (num_kv_heads * head_dim) + kv_head * head_dim + dims[None, :]
    kv_mask = n_mask[:, None] & (dims[None, :] < head_dim)
    k = _load_kv(k_cache_ptr, kv_off, kv_mask, q, FP8)  # [N, BLOCK_D]
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, N]
    if SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1), which saturates to +-1 without a NaN
        # x = s / cap_log2 and exp(2x) = exp2(2 * log2(e) * x)
        s = cap_log2 * (1.0 - 2.0 / (tl.exp2(s * (2.8853900817779268 / cap_log2)) + 1.0))
    s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = _load_kv(v_cache_ptr, kv_off, kv_mask, q, FP8)  # [N, BLOCK_D]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _with_sink(m_i, l_i, acc, sinks_ptr, heads, heads_ok):
    """Adds each row's sink logit (natural log, per query head) to its softmax: a term of the
    denominator with no value behind it."""
    sink = tl.load(sinks_ptr + heads, mask=heads_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr,
    out_ptr,  # [S, H, D]; written only when NUM_SPLITS == 1
    part_acc_ptr,  # [S, H, NUM_SPLITS, D] float32, unnormalised
    part_m_ptr, part_l_ptr,  # [S, H, NUM_SPLITS] float32
    sinks_ptr,  # [H] float32 (read only when SINKS)
    scale_log2, cap_log2, num_kv_heads, head_dim, block_size, tokens_per_split, window,
    stride_qs, stride_qh, stride_bt, v_factor,
    GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr, G_BLOCKS: tl.constexpr, SINKS: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1) // G_BLOCKS  # axis 1: (kv head, block of its query heads)
    g = (tl.program_id(1) % G_BLOCKS) * BLOCK_G + tl.arange(0, BLOCK_G)  # within the group
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g  # [BLOCK_G] query heads of this kv head
    qo_mask = (g < GROUP)[:, None] & (dims < head_dim)[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                mask=qo_mask, other=0.0)  # [BLOCK_G, BLOCK_D]
    # A finite start keeps exp2(m_i - m_new) defined for empty splits and zero-length sequences.
    m_i = tl.full([BLOCK_G], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    start = tl.maximum(start, seq_len - window)  # the window's first token (window: all if 0)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        m_i, l_i, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, bt_ptr + seq * stride_bt, offs_n, n_mask,
            n_mask[None, :], m_i, l_i, acc, kv_head, num_kv_heads, head_dim, block_size,
            scale_log2, cap_log2, BLOCK_D, DOT_PRECISION, FP8, SOFTCAP)
    num_heads = num_kv_heads * GROUP
    row = seq * num_heads + heads  # [BLOCK_G] index into [S, H]
    if NUM_SPLITS == 1:
        if SINKS:
            l_i, acc = _with_sink(m_i, l_i, acc, sinks_ptr, heads, g < GROUP)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if FP8:
            out = out * v_factor
        tl.store(out_ptr + row[:, None] * head_dim + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=qo_mask)
    else:
        part = row * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * head_dim + dims[None, :], acc, mask=qo_mask)
        tl.store(part_m_ptr + part, m_i, mask=g < GROUP)
        tl.store(part_l_ptr + part, l_i, mask=g < GROUP)


@triton.jit
def _decode_merge_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr, num_heads, head_dim, v_factor,
    NUM_SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr, SINKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # flattened (seq, head)
    sp = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    sp_mask = sp < NUM_SPLITS
    m = tl.load(part_m_ptr + row * NUM_SPLITS + sp, mask=sp_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + row * NUM_SPLITS + sp, mask=sp_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    sink = m_max
    if SINKS:  # the sink's logit joins the max and the denominator (log2 domain)
        sink = tl.load(sinks_ptr + row % num_heads).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    w = tl.exp2(m - m_max)  # [BLOCK_SPLITS]
    acc_off = (row * NUM_SPLITS + sp)[:, None] * head_dim + dims[None, :]
    acc_mask = sp_mask[:, None] & (dims < head_dim)[None, :]
    acc = tl.load(part_acc_ptr + acc_off, mask=acc_mask, other=0.0)  # [BLOCK_SPLITS, BLOCK_D]
    total = tl.sum(l * w, axis=0)
    if SINKS:
        total += tl.exp2(sink - m_max)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    if FP8:
        out = out * v_factor
    tl.store(out_ptr + row * head_dim + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_dim)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, cu_seqlens_ptr, seq_lens_ptr, out_ptr,
    sinks_ptr, scale_log2, cap_log2, num_kv_heads, head_dim, block_size, window,
    stride_qt, stride_qh, stride_bt, v_factor,
    GROUP: tl.constexpr, HEADS: tl.constexpr, H_BLOCKS: tl.constexpr,
    POSITIONS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
    SINKS: tl.constexpr, SOFTCAP: tl.constexpr,
):
    m_block = tl.program_id(0)
    kv_head = tl.program_id(1) // H_BLOCKS  # axis 1: (kv head, block of its query heads)
    h_block = tl.program_id(1) % H_BLOCKS
    seq = tl.program_id(2).to(tl.int64)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start  # int32, like every position below
    if m_block * POSITIONS >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    # Row r of the q tile is (new token r // HEADS, query head r % HEADS of this block), heads
    # fastest: one [ROWS, N] dot per KV tile serves every head of the block.
    r = tl.arange(0, ROWS)
    g = h_block * HEADS + r % HEADS  # [ROWS] head within the group
    offs_m = m_block * POSITIONS + r // HEADS  # [ROWS] index among the new tokens
    row_ok = (r < POSITIONS * HEADS) & (offs_m < q_len) & (g < GROUP)
    heads = kv_head * GROUP + g
    dims = tl.arange(0, BLOCK_D)
    qo_mask = row_ok[:, None] & (dims < head_dim)[None, :]
    q_rows = q_start.to(tl.int64) + offs_m
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=qo_mask, other=0.0)  # [ROWS, BLOCK_D]
    q_pos = prefix + offs_m  # absolute position of each row's token
    m_i = tl.full([ROWS], -1e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    # Causal: no query in this tile sees past its last token's position.
    kv_end = tl.minimum(prefix + (m_block + 1) * POSITIONS, seq_len)
    # Windowed: no query in this tile sees before its first token's window.
    kv_start = tl.maximum(prefix + m_block * POSITIONS - window + 1, 0)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        s_mask = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None]) \
            & (offs_n[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, bt_ptr + seq * stride_bt, offs_n, n_mask, s_mask,
            m_i, l_i, acc, kv_head, num_kv_heads, head_dim, block_size, scale_log2, cap_log2,
            BLOCK_D, DOT_PRECISION, FP8, SOFTCAP)
    if SINKS:
        l_i, acc = _with_sink(m_i, l_i, acc, sinks_ptr, heads, row_ok)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if FP8:
        out = out * v_factor
    num_heads = num_kv_heads * GROUP
    tl.store(out_ptr + (q_rows[:, None] * num_heads + heads[:, None]) * head_dim + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qo_mask)


def _dot_precision(dtype: torch.dtype) -> str:
    # tf32 would cost float32 callers ~1e-3 relative error; they asked for float32 for a reason.
    return "ieee" if dtype == torch.float32 else "tf32"


def _fp8_factors(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float, v_scale: float
                 ) -> tuple[bool, torch.Tensor, torch.Tensor, float, float]:
    """(fp8, the caches as the kernels read them, the score factor, the output factor)."""
    if k_cache.dtype != torch.float8_e4m3fn:
        return False, k_cache, v_cache, 1.0, 1.0
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, (int, float)) or not 0 < s < float("inf"):
            raise ValueError(f"{name} must be a positive finite float, got {s!r}")
    return (True, k_cache.view(torch.uint8), v_cache.view(torch.uint8),
            _FP8_UNIT * float(k_scale), _FP8_UNIT * float(v_scale))


DECODE_TILE_ELEMS = 16384  # query heads x head-dim tile of one decode program, at most


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its whole cached context (its last
    ``sliding_window`` tokens, the new one included, when given; None or 0: all of them).

    q: ``[S, H, D]`` (stride 1 in the last dim); k_cache, v_cache: ``[num_blocks, block_size,
    Hkv, D]`` contiguous, q's dtype or float8_e4m3fn (then K = code * k_scale, V = code *
    v_scale; the scales are ignored otherwise); block_tables: int32 ``[S, max_blocks]``; seq_lens: int32
    ``[S]``, the KV length including the new token (already written to the cache); a sequence
    with length 0 gets a zero output. ``num_splits``: split-K factor, chosen from the shapes when
    None. ``sinks``: ``[H]`` logits (natural log, the scores' scale) each head's softmax adds
    to its denominator. ``softcap``: each score s becomes softcap * tanh(s / softcap) before
    the softmax (Gemma 2). Returns a new contiguous ``[S, H, D]`` tensor of q's dtype.
    """
    check_tensor("q", q, 3, (torch.float16, torch.bfloat16, torch.float32))
    num_seqs, num_heads, head_dim = q.shape
    window, sinks = window_and_sinks(sliding_window, sinks, q)
    group = check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, scale)
    check_last_dim_contiguous("q", q)
    names = ["q", "k_cache", "v_cache", "block_tables", "seq_lens"]
    check_device(_decode_kernel, names, [q, k_cache, v_cache, block_tables, seq_lens])
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    fp8, k_cache, v_cache, k_factor, v_factor = _fp8_factors(k_cache, v_cache, k_scale, v_scale)
    if num_seqs == 0:
        return out
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    block_n = 64 if head_dim <= 128 else 32
    block_d = tile(head_dim)
    # a program takes at most DECODE_TILE_ELEMS of q (heads x dims): MLA's 128 heads of 576
    # (tile 1024) in one [128, 1024] tile would be 256 KB of bf16 and 512 KB of fp32
    # accumulator, over an H200's 228 KB of shared memory; blocks of 16 heads stay under it
    block_g = min(tile(group), max(16, DECODE_TILE_ELEMS // block_d))
    g_blocks = triton.cdiv(group, block_g)
    max_tokens = block_tables.shape[1] * block_size
    splits = pick_num_splits(num_splits, num_seqs * num_kv_heads * g_blocks, max_tokens,
                             q.device)
    tokens_per_split = triton.cdiv(triton.cdiv(max_tokens, splits), block_n) * block_n
    part_shape = (num_seqs, num_heads, splits)
    if splits > 1:
        part_acc = torch.empty(part_shape + (head_dim,), dtype=torch.float32, device=q.device)
        part_m = torch.empty(part_shape, dtype=torch.float32, device=q.device)
        part_l = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_m = part_l = out  # never touched on the single-split path
    sinks_arg = out if sinks is None else sinks  # never read without sinks
    _decode_kernel[(num_seqs, num_kv_heads * g_blocks, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_m, part_l, sinks_arg,
        scale * k_factor * _LOG2E, (softcap or 1.0) * _LOG2E, num_kv_heads, head_dim, block_size,
        tokens_per_split, window,
        q.stride(0), q.stride(1), block_tables.stride(0), v_factor,
        GROUP=group, NUM_SPLITS=splits, BLOCK_G=block_g, BLOCK_N=block_n,
        BLOCK_D=block_d, DOT_PRECISION=_dot_precision(q.dtype), FP8=fp8, G_BLOCKS=g_blocks,
        SINKS=sinks is not None, SOFTCAP=bool(softcap),
    )
    if splits > 1:
        _decode_merge_kernel[(num_seqs * num_heads,)](
            out, part_acc, part_m, part_l, sinks_arg, num_heads, head_dim, v_factor,
            NUM_SPLITS=splits, BLOCK_SPLITS=tile(splits, 1), BLOCK_D=tile(head_dim, 1),
            FP8=fp8, SINKS=sinks is not None,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened varlen batch of new tokens over the paged cache.

    q: ``[T, H, D]`` (stride 1 in the last dim); sequence i owns rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` (int32 ``[S+1]``), which are the last ``q_len`` of its
    ``seq_lens[i]`` tokens (int32 ``[S]``); their K/V must already be in the cache.
    ``max_seqlen_q``: at least the largest ``q_len`` (a smaller value leaves rows unwritten);
    pass it to avoid a device-to-host sync. An FP8 cache, ``sliding_window``, ``sinks`` and
    ``softcap``: as
    `paged_decode_attention`, per query row. Returns a new contiguous ``[T, H, D]`` tensor of
    q's dtype.
    """
    check_tensor("q", q, 3, (torch.float16, torch.bfloat16, torch.float32))
    num_tokens, num_heads, head_dim = q.shape
    window, sinks = window_and_sinks(sliding_window, sinks, q)
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,))
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("cu_seqlens_q must have num_seqs + 1 >= 1 entries")
    group = check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, scale)
    check_last_dim_contiguous("q", q)
    names = ["q", "k_cache", "v_cache", "block_tables", "cu_seqlens_q", "seq_lens"]
    tensors = [q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens]
    check_device(_prefill_kernel, names, tensors)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    fp8, k_cache, v_cache, k_factor, v_factor = _fp8_factors(k_cache, v_cache, k_scale, v_scale)
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    if max_seqlen_q <= 0:
        return out
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    t = prefill_tiles(head_dim, group, max_seqlen_q, q.element_size())
    h_blocks = triton.cdiv(group, t.heads)
    grid = (triton.cdiv(max_seqlen_q, t.positions), num_kv_heads * h_blocks, num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out,
        out if sinks is None else sinks,  # never read without sinks
        scale * k_factor * _LOG2E, (softcap or 1.0) * _LOG2E, num_kv_heads, head_dim,
        block_size, window,
        q.stride(0), q.stride(1), block_tables.stride(0), v_factor,
        GROUP=group, HEADS=t.heads, H_BLOCKS=h_blocks, POSITIONS=t.positions, ROWS=t.rows,
        BLOCK_N=t.block_n, BLOCK_D=tile(head_dim), DOT_PRECISION=_dot_precision(q.dtype),
        FP8=fp8, SINKS=sinks is not None, SOFTCAP=bool(softcap), num_warps=t.num_warps,
    )
    return out
