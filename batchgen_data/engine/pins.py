"""Prefix pins: KV a program will extend in its next step, kept out of the eviction queue.

A finished request frees its KV blocks; with prefix caching they stay hashed in the pool's LRU
free queue and a later prompt that starts with the same tokens reuses them — unless other work
recycles them first. A per-row program (`batchgen_data.programs`) knows its next step will
extend the conversation it just received, so the engine takes a reference on the cached blocks
of that conversation when the step finishes (`pin`), and drops it when the program ends
(`unpin`). The next step then finds its prefix however long it waits in the queue.

Pins are only an optimisation: they may hold at most `max_fraction` of the pool (a pin beyond
that is refused), and the engine drops all of them when the scheduler runs short of blocks
(`release_all`), so a pin can cost a recompute but never a stalled engine.
"""
from __future__ import annotations

from batchgen_data.kvcache.block_pool import BlockPool


class PrefixPins:
    def __init__(self, pool: BlockPool, max_fraction: float = 0.5) -> None:
        assert 0.0 < max_fraction <= 1.0
        self.pool = pool
        self.max_blocks = max(1, int(pool.num_blocks * max_fraction))
        self._pins: dict[str, list[int]] = {}  # key -> blocks referenced on its behalf
        self.num_blocks = 0  # references held, summed over keys
        self.num_refused = 0  # pins not taken: over the cap
        self.num_dropped = 0  # pins released early: the scheduler was short of blocks

    def __contains__(self, key: str) -> bool:
        return key in self._pins

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, key: str, token_ids: list[int]) -> int:
        """Reference the cached full blocks of `token_ids` under `key`; returns how many."""
        blocks, _ = self.pool.match_prefix(token_ids, len(token_ids), count_hits=False)
        if self.num_blocks + len(blocks) > self.max_blocks:
            # over the cap the newest pin is refused, not an older one: next steps queue in
            # the order their programs advanced, so the oldest pins are the next to be used
            self.pool.free(blocks)
            self.num_refused += 1
            return 0
        self._pins.setdefault(key, []).extend(blocks)
        self.num_blocks += len(blocks)
        return len(blocks)

    def unpin(self, key: str) -> bool:
        blocks = self._pins.pop(key, None)
        if blocks is None:
            return False
        if blocks:
            self.pool.free(blocks)
        self.num_blocks -= len(blocks)
        return True

    def release_all(self) -> int:
        """Drop every pin (the scheduler needs the blocks); returns how many were dropped."""
        n = len(self._pins)
        for key in list(self._pins):
            self.unpin(key)
        self.num_dropped += n
        return n
