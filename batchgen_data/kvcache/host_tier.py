"""Host-memory tier for held sequences' KV.

A held sequence either keeps its KV here (resume = copy back, no recompute) or drops it (resume =
recompute through the prefix cache, which often still holds most of its blocks). The tier has a
byte budget; when it is full, holds fall back to recompute rather than failing.
"""
from __future__ import annotations

from typing import Any

import torch

HostKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v [num_tokens, Hkv, D]


def kv_nbytes(kv: HostKV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


class HostKVTier:
    def __init__(self, capacity_bytes: int, bytes_per_token: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.bytes_per_token = bytes_per_token
        self.used_bytes = 0
        self._owners: dict[int, int] = {}  # seq_id -> bytes

    def fits(self, num_tokens: int) -> bool:
        return self.used_bytes + num_tokens * self.bytes_per_token <= self.capacity_bytes

    def put(self, seq: Any, kv: HostKV) -> None:
        assert seq.seq_id not in self._owners
        n = kv_nbytes(kv)
        self._owners[seq.seq_id] = n
        self.used_bytes += n
        seq.host_kv = kv

    def take(self, seq: Any) -> HostKV:
        kv = seq.host_kv
        self.drop(seq)
        return kv

    def drop(self, seq: Any) -> None:
        n = self._owners.pop(seq.seq_id, 0)
        self.used_bytes -= n
        seq.host_kv = None
