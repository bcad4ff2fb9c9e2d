from __future__ import annotations

import pytest

from batchgen_data.core.kv.block_pool import BlockPool


def test_allocate_free_refcounts() -> None:
    pool = BlockPool(4, 2)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    with pytest.raises(MemoryError):
        pool.allocate(2)
    pool.free(a)
    assert pool.num_free == 4
    with pytest.raises(AssertionError):
        pool.free([a[0]])


def test_prefix_hit_shares_blocks_and_survives_free() -> None:
    pool = BlockPool(8, 2)
    tokens = [1, 2, 3, 4, 5]
    blocks = pool.allocate(3)
    parent = None
    for i in range(2):  # two full blocks
        parent = pool.register(blocks[i], parent, tuple(tokens[2 * i:2 * i + 2]))
    hit, hashes = pool.match_prefix([1, 2, 3, 4, 9, 9], 5)
    assert hit == blocks[:2] and len(hashes) == 2
    assert pool.ref_counts[blocks[0]] == 2
    pool.free(blocks)
    pool.free(hit)
    # freed but still cached: a later request hits without recomputation
    again, _ = pool.match_prefix([1, 2, 3, 4], 4)
    assert again == blocks[:2]
    # a different first block breaks the chain even if the second matches
    miss, _ = pool.match_prefix([7, 7, 3, 4], 4)
    assert miss == []


def test_cached_blocks_are_evicted_oldest_first_when_memory_is_needed() -> None:
    pool = BlockPool(3, 1)
    b = pool.allocate(3)
    h = None
    for i, blk in enumerate(b):
        h = pool.register(blk, h, (i,))
    pool.free(b)  # tail freed first: block b[2] is the oldest free one
    pool.allocate(1)
    hit, _ = pool.match_prefix([0, 1, 2], 3)
    assert hit == b[:2]


def test_prefix_caching_disabled() -> None:
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    blk = pool.allocate(1)
    pool.register(blk[0], None, (1, 2))
    assert pool.match_prefix([1, 2, 3], 2) == ([], [])
