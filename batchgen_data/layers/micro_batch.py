"""A step's attention cut into micro-batches of sequences (`AttentionMetadata.micro_batches`).

The runner attends an MoE model's step in micro-batches when `attention_micro_batch_seqs` is set,
while each MoE layer still runs once over the whole step, so the expert batch is not bounded by
what one attention batch may hold (the torch decode path gathers every sequence's KV blocks at
once). A micro-batch is a run of consecutive sequences of the flattened step: decodes first, then
prefill chunks, as `ModelRunner.prepare` lays them out, so its tokens are one contiguous row range.
"""
from __future__ import annotations

from itertools import accumulate

from batchgen_data.layers.attention import AttentionMetadata, AttentionPart


def split_by_sequences(meta: AttentionMetadata, max_seqs: int) -> list[AttentionPart]:
    """The micro-batches of at most `max_seqs` consecutive sequences, in order (their KV in
    the step's caches)."""
    assert max_seqs >= 1
    nd = meta.num_decodes
    q_lens = meta.query_lens_host
    num_seqs = len(q_lens)
    starts = [0, *accumulate(q_lens)]  # first token row of each sequence
    nblk = meta.decode_blocks.numel() // nd if meta.decode_blocks is not None and nd else 0
    parts = []
    for a in range(0, num_seqs, max_seqs):
        b = min(a + max_seqs, num_seqs)
        rows = slice(starts[a], starts[b])
        decodes = max(0, min(b, nd) - a)
        first_prefill = max(a, nd) - nd  # index among the step's prefills
        num_prefills = b - max(a, nd) if b > nd else 0
        cu = meta.cu_seqlens_q[first_prefill:first_prefill + num_prefills + 1]
        sub = AttentionMetadata(
            slot_mapping=meta.slot_mapping[rows], num_decodes=decodes,
            block_tables=meta.block_tables[a:b], seq_lens=meta.seq_lens[a:b],
            cu_seqlens_q=cu - cu[0],
            seq_lens_host=meta.seq_lens_host[a:b], query_lens_host=q_lens[a:b],
            max_decode_len=max(meta.seq_lens_host[a:a + decodes], default=0),
            max_prefill_len=max(q_lens[a + decodes:b], default=0))
        if decodes and nblk:  # the torch decode path's gather index, cut to these rows
            sub.decode_blocks = meta.decode_blocks[a * nblk:(a + decodes) * nblk]
            sub.decode_mask = meta.decode_mask[a:a + decodes]
        parts.append(AttentionPart(rows, sub))
    return parts
