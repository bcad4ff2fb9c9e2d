"""Cutting a step's attention metadata into micro-batches of sequences (MoE models)."""
from __future__ import annotations

import torch

from batchgen_data.layers.attention import AttentionMetadata
from batchgen_data.layers.micro_batch import split_by_sequences


def step_metadata() -> AttentionMetadata:
    # 3 decodes (KV lengths 5, 9, 2), then prefill chunks of 4 and 3 tokens (KV 4 and 7)
    q_lens, seq_lens = [1, 1, 1, 4, 3], [5, 9, 2, 4, 7]
    nblk = 3  # decode gather width: ceil(9 / 4) blocks of 4
    meta = AttentionMetadata(
        slot_mapping=torch.arange(100, 110), num_decodes=3,
        block_tables=torch.arange(15, dtype=torch.int32).view(5, 3),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 4, 7], dtype=torch.int32),
        seq_lens_host=seq_lens, query_lens_host=q_lens, max_decode_len=9, max_prefill_len=4)
    meta.decode_blocks = torch.arange(3 * nblk)
    meta.decode_mask = torch.arange(3 * 12).view(3, 1, 1, 12) % 2 == 0
    return meta


def test_groups_of_two_sequences_keep_rows_and_metadata_aligned() -> None:
    meta = step_metadata()
    parts = split_by_sequences(meta, 2)
    assert [p.rows for p in parts] == [slice(0, 2), slice(2, 7), slice(7, 10)]
    a, b, c = (p.meta for p in parts)
    assert (a.num_decodes, b.num_decodes, c.num_decodes) == (2, 1, 0)
    assert a.decode_blocks.tolist() == list(range(6)) and a.max_decode_len == 9
    assert b.decode_blocks.tolist() == [6, 7, 8] and b.max_decode_len == 2
    assert torch.equal(b.decode_mask, meta.decode_mask[2:3])
    assert b.cu_seqlens_q.tolist() == [0, 4] and b.max_prefill_len == 4
    assert c.cu_seqlens_q.tolist() == [0, 3] and c.max_prefill_len == 3
    assert c.block_tables.tolist() == meta.block_tables[4:].tolist()
    assert c.slot_mapping.tolist() == list(range(107, 110))
    assert a.cu_seqlens_q.tolist() == [0]  # no prefill in the first group
    assert sum(len(p.meta.query_lens_host) for p in parts) == 5


def test_one_group_when_the_limit_holds_the_step() -> None:
    (rows, sub, _), = split_by_sequences(step_metadata(), 8)
    assert rows == slice(0, 10) and sub.num_decodes == 3 and sub.cu_seqlens_q.tolist() == [0, 4, 7]
