"""A micro-batch of the KV host tier in block ids, and its attention metadata.

A micro-batch is a run of sequences attended together, laid out as the runner lays out a step:
decodes first, then prefill chunks. Its tables name blocks of whichever cache it attends in (the
device cache, the host tier's caches, or the staging cache), so `metadata` serves every place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen_data.layers.attention import AttentionMetadata


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch in host block ids: decodes first, then prefill chunks (the runner's
    layout). `tables[i]` are sequence i's host KV blocks; `seq_lens` its KV length after this
    step; `query_lens` its new tokens."""

    tables: list[list[int]]
    seq_lens: list[int]
    query_lens: list[int]

    @property
    def num_decodes(self) -> int:
        return sum(q == 1 for q in self.query_lens)

    def work(self, num_heads: int, num_kv_heads: int, head_dim: int, itemsize: int
             ) -> tuple[int, int, int]:
        """(KV bytes read, q/k/v/out bytes, flops) of one layer's attention over this batch."""
        kv = sum(self.seq_lens) * 2 * num_kv_heads * head_dim * itemsize
        tokens = sum(self.query_lens)
        io = tokens * (2 * num_heads + 2 * num_kv_heads) * head_dim * itemsize
        # QK^T and PV: 2 flops per multiply-add each, every new token against its whole context
        flops = sum(4 * q * s * num_heads * head_dim
                    for q, s in zip(self.query_lens, self.seq_lens))
        return kv, io, flops


def metadata(batch: MicroBatch, block_size: int, device: torch.device,
             torch_decode: bool) -> AttentionMetadata:
    """The attention metadata of `batch` with its block ids as given, on `device`."""
    slots: list[int] = []
    for table, s, q in zip(batch.tables, batch.seq_lens, batch.query_lens):
        slots.extend(table[p // block_size] * block_size + p % block_size
                     for p in range(s - q, s))
    nd = batch.num_decodes
    width = max(map(len, batch.tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in batch.tables], dtype=torch.int32)
    prefill_q = batch.query_lens[nd:]
    cu = [0]
    for q in prefill_q:
        cu.append(cu[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device), num_decodes=nd,
        block_tables=table.to(device), seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32,
                                                             device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens_host=list(batch.seq_lens), query_lens_host=list(batch.query_lens),
        max_decode_len=max(batch.seq_lens[:nd], default=0), max_prefill_len=max(prefill_q,
                                                                                default=0))
    if nd and torch_decode:  # the torch decode path gathers whole blocks (model_runner.py)
        nblk = -(-meta.max_decode_len // block_size)
        mask = (torch.arange(nblk * block_size).unsqueeze(0)
                < torch.tensor(batch.seq_lens[:nd]).unsqueeze(1))
        meta.decode_blocks = table[:nd, :nblk].reshape(-1).long().to(device)
        meta.decode_mask = mask[:, None, None, :].to(device)
    return meta
