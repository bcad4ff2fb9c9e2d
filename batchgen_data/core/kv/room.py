"""Room for a sequence's next tokens in the block pool's tiers: how many blocks it needs, which
tier it grows in, whether they are free, and handing them out.

A sequence's blocks all sit in one tier (the device's, or the KV host tier's: `BlockPool` with
`num_host_blocks`), so one that has blocks grows in its own tier and a new one takes the device
first. `keep_free` blocks stay free in the device tier (the scheduler's admission watermark),
and then a hundredth of the host tier too. The scheduler (core/scheduler.py) asks these; what
to do when there is no room (reclaim pins, preempt) is its decision.

A model whose every layer attends over a sliding window (`BlockPool.window`, the widest of
them) never reads a position again once every later query's window has passed it: `trim`
frees the blocks wholly before that point and leaves `NULL_BLOCK` in their place, so a long
row holds about window / block_size + 1 blocks. The entries keep their positions (block j
still holds positions [j * block_size, (j + 1) * block_size)); no attention path reads them
(the kernels start at the window, the torch decode gathers them masked: worker/model_runner).
"""
from __future__ import annotations

from batchgen_data.core.kv.block_pool import BlockPool
from batchgen_data.core.sequence import Sequence


NULL_BLOCK = -1  # a block-table entry whose block `trim` freed


def trim(pool: BlockPool, seq: Sequence, computed: int) -> int:
    """Free `seq`'s blocks that no later query sees (`pool.window` set, `computed` tokens of
    `seq` done: the next query, at position `computed`, sees positions from
    computed - window + 1 on); returns how many it freed. A sequence in the host tier keeps
    its blocks (the tier's caches are staged whole)."""
    window = pool.window
    if not window or not seq.block_ids or on_host(pool, seq):
        return 0
    dead = min(max(0, computed - window + 1) // pool.block_size, len(seq.block_ids))
    freed = [b for b in seq.block_ids[:dead] if b != NULL_BLOCK]
    if freed:
        pool.free(freed)
        seq.block_ids[:dead] = [NULL_BLOCK] * dead
    return len(freed)


def live_blocks(block_ids: list[int]) -> list[int]:
    """The blocks a sequence holds (its list without `trim`'s NULL_BLOCK entries)."""
    return [b for b in block_ids if b != NULL_BLOCK]


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
