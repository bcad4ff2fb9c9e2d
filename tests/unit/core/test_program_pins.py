"""PrefixPins as programs use them: a key holds each block once however many steps pin it, and
`reclaim` gives blocks back one key at a time, in the order asked, only as many as needed."""
from __future__ import annotations

from batchgen_data.core.pins import PrefixPins
from batchgen_data.core.kv.block_pool import BlockPool


def finished(pool: BlockPool, tokens: list[int]) -> None:
    """Blocks computed for `tokens`, registered for reuse and freed, as a finished request."""
    bs = pool.block_size
    blocks = pool.allocate(len(tokens) // bs)
    parent = None
    for i, b in enumerate(blocks):
        parent = pool.register(b, parent, tuple(tokens[i * bs:(i + 1) * bs]))
    pool.free(blocks)


def test_a_later_step_pins_only_its_new_blocks() -> None:
    pool = BlockPool(num_blocks=16, block_size=2)
    step1 = [1, 2, 3, 4]
    step2 = step1 + [5, 6, 7, 8]  # the next prompt repeats the conversation
    finished(pool, step1)
    pins = PrefixPins(pool, max_fraction=1.0)
    assert pins.pin("p", step1) == 2
    finished(pool, step2)
    assert pins.pin("p", step2) == 2 and pins.num_blocks == 4 and pins.num_pinned == 2
    assert pool.num_free == 12  # four blocks, each referenced once
    assert pins.pin("p", step2) == 0 and pins.num_blocks == 4 and pool.num_free == 12
    assert pins.unpin("p") and pool.num_free == 16
    assert all(r == 0 for r in pool.ref_counts)


def test_reclaim_drops_keys_in_order_until_enough_is_free() -> None:
    pool = BlockPool(num_blocks=12, block_size=2)
    convs = {k: [10 * i + j for j in range(6)] for i, k in enumerate("abc", start=1)}
    for toks in convs.values():
        finished(pool, toks)
    pins = PrefixPins(pool, max_fraction=1.0)
    for k, toks in convs.items():
        assert pins.pin(k, toks) == 3
    assert pool.num_free == 3
    # 4 blocks needed: the first key in the order frees 3, the second one more than enough
    assert pins.reclaim(4, ["c", "b", "a"]) == 6
    assert "a" in pins and "b" not in pins and "c" not in pins
    assert pins.num_dropped == 2 and pins.num_dropped_blocks == 6 and pins.num_blocks == 3
    assert pins.reclaim(1, []) == 0  # nothing offered: nothing taken
    assert pins.reclaim(0, ["a"]) == 0 and "a" in pins  # nothing needed


def test_reclaim_counts_only_blocks_it_really_freed() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    toks = [1, 2, 3, 4]
    finished(pool, toks)
    pins = PrefixPins(pool, max_fraction=1.0)
    pins.pin("p", toks)
    running, _ = pool.match_prefix(toks, len(toks))  # a running step shares the prefix
    assert pins.reclaim(2, ["p"]) == 0 and "p" not in pins and pins.num_dropped == 1
    pool.free(running)
    assert pool.num_free == 8
