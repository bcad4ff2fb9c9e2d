"""Group routed (token, expert) pairs by expert, each group padded to the GEMM block.

The grouped GEMM of ``fused_moe.py`` gives each program one block of ``block_size`` rows that all
belong to one expert, so it needs the routed pairs sorted by expert and every expert's list
padded to a multiple of ``block_size``. This is the job of vLLM's ``moe_align_block_size``; this
version is written from scratch in three deterministic Triton launches (no atomics, so a given
routing always yields the same order, and pairs keep their token order inside an expert):

1. ``_count_kernel``: each of at most 64 programs takes a chunk of the flattened ``topk_ids``
   and counts its pairs per expert into ``counts[chunk, e]`` (sub-tile by sub-tile).
2. ``_scan_kernel`` (one program): prefix sums over chunks and over padded expert sizes turn the
   counts into ``base[chunk, e]`` (where the chunk's first pair for ``e`` goes), the block to
   expert map and the padded total.
3. ``_scatter_kernel``: each pair lands at ``base[chunk, e]`` plus its rank among the pairs of
   ``e`` earlier in its chunk (a cumulative sum over a one-hot tile, carried across sub-tiles).
Experts that receive no pair get no block at all, so an idle expert costs nothing downstream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_device, check_tensor

_MAX_CHUNKS = 64  # programs of the count and scatter kernels; the scan loops over them
_ONE_HOT_ELEMS = 8192  # pairs x experts compared at once, to keep the one-hot in registers


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, numel, num_experts, chunk_len,
                  SUB: tl.constexpr, BLOCK_E: tl.constexpr):
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s in range(0, chunk_len, SUB):
        offs = chunk * chunk_len + s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)  # [SUB]
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)  # [SUB, BLOCK_E] one-hot
        total += tl.sum(hits, axis=0)
    tl.store(counts_ptr + chunk * num_experts + experts, total, mask=experts < num_experts)


@triton.jit
def _scan_kernel(counts_ptr, expert_ids_ptr, total_ptr, num_chunks, num_experts, max_blocks,
                 block_size, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    experts = tl.arange(0, BLOCK_E)
    emask = experts < num_experts
    running = tl.zeros([BLOCK_E], dtype=tl.int32)  # pairs per expert in the chunks so far
    for c in range(num_chunks):
        row = counts_ptr + c * num_experts + experts
        n = tl.load(row, mask=emask, other=0)
        tl.store(row, running, mask=emask)  # counts become per-chunk offsets inside the expert
        running += n
    padded = (running + block_size - 1) // block_size * block_size  # [BLOCK_E]
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.debug_barrier()  # the offsets stored above are read back, maybe by other threads
    for c in range(num_chunks):
        row = counts_ptr + c * num_experts + experts
        tl.store(row, tl.load(row, mask=emask, other=0) + starts, mask=emask)
    total = tl.sum(padded, axis=0)
    tl.store(total_ptr, total)
    # block b belongs to the expert whose padded range holds row b * block_size: the number of
    # experts that end at or before it; blocks past the total are marked -1
    for b0 in range(0, max_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first_row = blocks * block_size
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        expert = tl.where(first_row < total, expert, -1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < max_blocks)


@triton.jit
def _scatter_kernel(ids_ptr, base_ptr, sorted_ptr, numel, num_experts, chunk_len,
                    SUB: tl.constexpr, BLOCK_E: tl.constexpr):
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    # next free slot of each expert for this chunk, carried across its sub-tiles
    nxt = tl.load(base_ptr + chunk * num_experts + experts, mask=experts < num_experts, other=0)
    for s in range(0, chunk_len, SUB):
        offs = chunk * chunk_len + s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
        valid = (offs < numel) & (ids >= 0) & (ids < num_experts)
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)  # [SUB, BLOCK_E]
        # slot = the expert's next free slot + rank among its earlier pairs in this sub-tile
        slot = tl.sum(hits * (nxt[None, :] + tl.cumsum(hits, axis=0) - 1), axis=1)
        tl.store(sorted_ptr + slot, offs.to(tl.int32), mask=valid)
        nxt += tl.sum(hits, axis=0)


def max_padded_pairs(numel: int, num_experts: int, block_size: int) -> int:
    """Upper bound on the padded length: each expert that gets a pair pads at most block-1."""
    return numel + min(num_experts, numel) * (block_size - 1)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the routed pairs by expert, padding each expert's list to ``block_size``.

    topk_ids: ``[T, k]`` int32/int64 expert of each (token, slot) pair; a pair whose id lies
    outside ``[0, num_experts)`` (-1: an expert held elsewhere) is left out. Returns, all int32 on topk_ids' device:
      sorted_token_ids ``[P]``: flat pair indices ``t * k + j`` grouped by expert in ascending
        expert order, token order kept inside an expert; padding holds ``T * k`` (never a pair);
      expert_ids ``[ceil(P / block_size)]``: the expert of each block, -1 past the padded total;
      num_tokens_post_padded ``[1]``: the padded total (a multiple of ``block_size``).
    ``P = max_padded_pairs(T * k, num_experts, block_size)``; entries past the total are padding.
    """
    topk_ids = check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64))
    if block_size < 1 or num_experts < 1:
        raise ValueError(f"block_size ({block_size}) and num_experts ({num_experts}) must be >= 1")
    check_device(_count_kernel, ["topk_ids"], [topk_ids])
    ids = topk_ids.contiguous().view(-1)
    numel, dev = ids.numel(), ids.device
    padded_len = max_padded_pairs(numel, num_experts, block_size)
    max_blocks = triton.cdiv(padded_len, block_size)
    sorted_ids = torch.full((padded_len,), numel, dtype=torch.int32, device=dev)
    expert_ids = torch.full((max_blocks,), -1, dtype=torch.int32, device=dev)
    total = torch.zeros(1, dtype=torch.int32, device=dev)
    if numel == 0:
        return sorted_ids, expert_ids, total
    block_e = triton.next_power_of_2(num_experts)
    sub = max(16, min(256, _ONE_HOT_ELEMS // block_e))
    chunk_len = max(sub, triton.cdiv(triton.cdiv(numel, _MAX_CHUNKS), sub) * sub)
    num_chunks = triton.cdiv(numel, chunk_len)
    counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=dev)
    _count_kernel[(num_chunks,)](ids, counts, numel, num_experts, chunk_len,
                                 SUB=sub, BLOCK_E=block_e)
    _scan_kernel[(1,)](counts, expert_ids, total, num_chunks, num_experts, max_blocks,
                       block_size, BLOCK_E=block_e, BLOCK_B=64)
    _scatter_kernel[(num_chunks,)](ids, counts, sorted_ids, numel, num_experts, chunk_len,
                                   SUB=sub, BLOCK_E=block_e)
    return sorted_ids, expert_ids, total
