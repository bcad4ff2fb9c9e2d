"""Freeing the KV blocks that every layer's sliding window has passed (core/kv/room.trim),
counted against the positions a later query can still see."""
from __future__ import annotations

from batchgen_data.core.kv import room
from batchgen_data.core.kv.block_pool import BlockPool
from batchgen_data.core.sequence import Sequence
from batchgen_data.sampling_params import SamplingParams


def _seq(n_blocks: int, pool: BlockPool) -> Sequence:
    seq = Sequence(0, "r", 0, list(range(100)), SamplingParams(), 0, 16)
    seq.block_ids = pool.allocate(n_blocks)
    return seq


def test_trim_frees_exactly_the_blocks_no_later_query_sees() -> None:
    pool = BlockPool(32, 4)
    pool.window = 6
    seq = _seq(10, pool)  # 40 positions
    for computed in range(0, 41):
        before = list(seq.block_ids)
        room.trim(pool, seq, computed)
        first_seen = max(0, computed - 6 + 1)  # the next query (at `computed`) sees from here
        for j, b in enumerate(seq.block_ids):
            if (j + 1) * 4 <= first_seen:  # wholly before the window: freed
                assert b == room.NULL_BLOCK
            else:  # some position in it is still seen: kept as it was
                assert b == before[j] != room.NULL_BLOCK
    assert pool.num_free == 32 - len(room.live_blocks(seq.block_ids))
    assert len(room.live_blocks(seq.block_ids)) <= 6 // 4 + 1


def test_no_window_or_global_layers_keep_every_block() -> None:
    pool = BlockPool(16, 4)
    seq = _seq(8, pool)
    assert room.trim(pool, seq, 32) == 0 and room.NULL_BLOCK not in seq.block_ids
    pool.window = 4
    assert room.trim(pool, seq, 32) == 7  # positions 29.. seen: block 7 kept
    assert room.trim(pool, seq, 32) == 0  # nothing freed twice
