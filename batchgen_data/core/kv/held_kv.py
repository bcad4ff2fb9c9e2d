"""The KV of held sequences, copied out of the KV cache (vLLM's swap space: `held_kv_bytes`).

A held (or preempted) sequence does not run: it either keeps a copy of its KV here (resume =
copy back, no recompute) or drops it (resume = recompute through the prefix cache, which often
still holds most of its blocks). The store has a byte budget; when it is full, holds fall back
to recompute rather than failing (`decide_held_kv`, the one rule for every hold). Not to be
confused with the KV host tier (`host_kv_tier_bytes`, `worker/kv_tier/`): host blocks of the
block pool where *running* sequences keep their KV.
"""
from __future__ import annotations

from typing import Any

import torch

from batchgen_data.core.sequence import Sequence

KVCopy = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v [num_tokens, Hkv, D]


def kv_nbytes(kv: KVCopy) -> int:
    """Bytes a copy holds; a one-plane cache's copy (V the very tensor K is) counts once."""
    return sum(k.numel() * k.element_size() + (0 if v is k else v.numel() * v.element_size())
               for k, v in kv)


class HeldKVStore:
    def __init__(self, capacity_bytes: int, bytes_per_token: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.bytes_per_token = bytes_per_token
        self.used_bytes = 0
        self._owners: dict[int, int] = {}  # seq_id -> bytes

    def fits(self, num_tokens: int) -> bool:
        return self.used_bytes + num_tokens * self.bytes_per_token <= self.capacity_bytes

    def put(self, seq: Any, kv: KVCopy) -> None:
        assert seq.seq_id not in self._owners
        n = kv_nbytes(kv)
        self._owners[seq.seq_id] = n
        self.used_bytes += n
        seq.held_kv = kv

    def take(self, seq: Any) -> KVCopy:
        kv = seq.held_kv
        self.drop(seq)
        return kv

    def drop(self, seq: Any) -> None:
        n = self._owners.pop(seq.seq_id, 0)
        self.used_bytes -= n
        seq.held_kv = None


def decide_held_kv(seq: Sequence, host: HeldKVStore, keep: bool) -> bool:
    """The one keep-or-drop-KV rule for a sequence being held (for memory, by the user, for an
    export) or arriving with shipped KV. Its KV stays, in the host tier, when `keep` is asked for,
    there is KV at all and the tier has room for it; otherwise it is dropped here
    (`num_computed_tokens` back to 0) and recomputed when the sequence runs again.

    Returns True when the caller must copy the sequence's KV into the host tier now; KV already
    there stays (or is dropped when `keep` is False). The scheduler asks when it preempts and the
    engine asks again when it copies: earlier copies of the same step may have filled the tier.
    """
    if seq.held_kv is not None:
        if keep:
            return False
        host.drop(seq)
    elif keep and seq.num_computed_tokens > 0 and host.fits(seq.num_computed_tokens):
        return True
    seq.num_computed_tokens = 0
    return False
