"""Room for a sequence's next tokens in the block pool's tiers: how many blocks it needs, which
tier it grows in, whether they are free, and handing them out.

A sequence's blocks all sit in one tier (the device's, or the KV host tier's: `BlockPool` with
`num_host_blocks`), so one that has blocks grows in its own tier and a new one takes the device
first. `keep_free` blocks stay free in the device tier (the scheduler's admission watermark),
and then a hundredth of the host tier too. The scheduler (core/scheduler.py) asks these; what
to do when there is no room (reclaim pins, preempt) is its decision.
"""
from __future__ import annotations

from batchgen_data.core.kv.block_pool import BlockPool
from batchgen_data.core.sequence import Sequence


def blocks_needed(pool: BlockPool, seq: Sequence, n: int) -> int:
    """Blocks `seq` lacks for `n` tokens beyond its computed ones."""
    bs = pool.block_size
    total = -(-(seq.num_computed_tokens + n) // bs)
    return max(0, total - len(seq.block_ids))


def on_host(pool: BlockPool, seq: Sequence) -> bool:
    """Whether `seq`'s blocks are in the host tier."""
    return bool(seq.block_ids) and pool.is_host(seq.block_ids[0])


def tier_for(pool: BlockPool, seq: Sequence, n: int, keep_free: int) -> bool | None:
    """The tier `seq` grows `n` tokens in (False: device, True: host), None when it has no
    room: its own tier once it has blocks, else the device first."""
    need = blocks_needed(pool, seq, n)
    host_keep = max(1, pool.num_host_blocks // 100) if keep_free else 0
    if seq.block_ids:
        if on_host(pool, seq):
            return True if need + host_keep <= pool.num_free_host else None
        return False if need + keep_free <= pool.num_free else None
    if need + keep_free <= pool.num_free:
        return False
    if pool.num_host_blocks and need + host_keep <= pool.num_free_host:
        return True
    return None


def can_grow(pool: BlockPool, seq: Sequence, n: int, keep_free: int) -> bool:
    return tier_for(pool, seq, n, keep_free) is not None


def grow(pool: BlockPool, seq: Sequence, n: int, keep_free: int = 0) -> None:
    """Give `seq` the blocks for `n` tokens beyond its computed ones (they must be free), in
    the tier `tier_for` picks with the same `keep_free`."""
    need = blocks_needed(pool, seq, n)
    if need:
        host = tier_for(pool, seq, n, keep_free)
        assert host is not None, "grow without room"
        seq.block_ids.extend(pool.allocate(need, host=host))
