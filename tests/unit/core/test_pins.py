"""PrefixPins over a real BlockPool: a pin keeps a finished conversation's cached blocks out of
the free queue, refuses past its cap, and gives everything back on unpin/release_all."""
from __future__ import annotations

from batchgen_data.core.pins import PrefixPins
from batchgen_data.core.kv.block_pool import BlockPool


def finished_conversation(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Blocks computed for `tokens`, registered for reuse and freed, as a finished request."""
    bs = pool.block_size
    blocks = pool.allocate(len(tokens) // bs)
    parent = None
    for i, b in enumerate(blocks):
        parent = pool.register(b, parent, tuple(tokens[i * bs:(i + 1) * bs]))
    pool.free(blocks)
    return blocks


def test_a_pinned_prefix_survives_other_work_and_is_released() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7]  # three full blocks and a partial one
    blocks = finished_conversation(pool, tokens)
    pins = PrefixPins(pool, max_fraction=0.5)
    hits = pool.hits
    assert pins.pin("p", tokens) == 3 and "p" in pins and pins.num_blocks == 3
    assert pool.hits == hits  # a pin is not a prompt being served
    other = pool.allocate(pool.num_free)  # everything else is recycled meanwhile
    assert len(other) == 5 and not set(other) & set(blocks)
    again, _ = pool.match_prefix(tokens, len(tokens))
    assert again == blocks  # the next step finds the whole prefix
    pool.free(again)
    pool.free(other)
    assert pins.unpin("p") and not pins.unpin("p")
    assert pool.num_free == 8 and pins.num_blocks == 0


def test_pins_past_the_cap_are_refused_and_release_all_frees_everything() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    a, b = [1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4]
    finished_conversation(pool, a)
    finished_conversation(pool, b)
    pins = PrefixPins(pool, max_fraction=0.5)  # four blocks at most
    assert pins.pin("a", a) == 3
    assert pins.pin("b", b) == 0 and pins.num_refused == 1 and "b" not in pins
    assert pool.num_free == 5
    assert pins.release_all() == 1 and pool.num_free == 8 and len(pins) == 0
