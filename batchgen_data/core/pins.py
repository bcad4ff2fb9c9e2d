"""Prefix pins: KV a program will extend in its next step, kept out of the eviction queue.

A finished request frees its KV blocks; with prefix caching they stay hashed in the pool's LRU
free queue and a later prompt that starts with the same tokens reuses them — unless other work
recycles them first. A per-row program (`batchgen_data.programs`) knows its next step will
extend the conversation it just received, so the engine takes a reference on the cached blocks
of that conversation when the step finishes (`pin`), and drops it when the program ends
(`unpin`). The next step then finds its prefix however long it waits in the queue.

A key holds each block once: a later step's conversation repeats the earlier one, so pinning it
adds only its new blocks (a fan-out's branches are kept side by side).

Pins are only an optimisation: they may hold at most `max_fraction` of the pool (a pin beyond
that is refused), and when the scheduler runs short of blocks the engine takes them back one
key at a time, least valuable first (`reclaim`: the program furthest from its next step), before
it preempts anything; a pin can cost its program a recompute but never stalls the engine.
"""
from __future__ import annotations

from collections.abc import Iterable

from batchgen_data.core.kv.block_pool import BlockPool


class PrefixPins:
    def __init__(self, pool: BlockPool, max_fraction: float = 0.9) -> None:
        assert 0.0 < max_fraction <= 1.0
        self.pool = pool
        self.max_blocks = max(1, int(pool.num_blocks * max_fraction))
        self._pins: dict[str, dict[int, None]] = {}  # key -> blocks referenced on its behalf
        self.num_blocks = 0  # references held, summed over keys
        self.num_pinned = 0  # pins taken (a key pinned again after a later step counts again)
        self.num_refused = 0  # pins not taken: over the cap
        self.num_dropped = 0  # keys released early: the scheduler was short of blocks
        self.num_dropped_blocks = 0  # pool blocks those early releases gave back

    def __contains__(self, key: str) -> bool:
        return key in self._pins

    def __len__(self) -> int:
        return len(self._pins)

    def keys(self) -> list[str]:
        return list(self._pins)

    def blocks_of(self, key: str) -> list[int]:
        """The pool blocks `key` references (empty when it holds none)."""
        return list(self._pins.get(key, ()))

    def pin(self, key: str, token_ids: list[int], root: int | None = None) -> int:
        """Reference the cached full blocks of `token_ids` (in the prefix-cache chain from
        `root`: a LoRA adapter's) under `key`; returns how many new blocks the key holds now
        (0 when refused or nothing new was cached)."""
        blocks, _ = self.pool.match_prefix(token_ids, len(token_ids), count_hits=False,
                                           root=root)
        held = self._pins.get(key, {})
        new = [b for b in blocks if b not in held]
        again = [b for b in blocks if b in held]
        if again:
            self.pool.free(again)  # the key references these already
        if not new:
            return 0
        if self.num_blocks + len(new) > self.max_blocks:
            # over the cap the newest pin is refused, not an older one: an older pin's program
            # is as near its next step, and it keeps what it pinned before
            self.pool.free(new)
            self.num_refused += 1
            return 0
        self._pins.setdefault(key, {}).update(dict.fromkeys(new))
        self.num_blocks += len(new)
        self.num_pinned += 1
        return len(new)

    def unpin(self, key: str) -> bool:
        blocks = self._pins.pop(key, None)
        if blocks is None:
            return False
        if blocks:
            self.pool.free(list(blocks))
        self.num_blocks -= len(blocks)
        return True

    def reclaim(self, need: int, order: Iterable[str]) -> int:
        """Drop pins in `order` (least valuable first) until `need` pool blocks are free again,
        or `order` runs out; returns the blocks freed. Blocks still in use elsewhere (a shared
        system prompt, a running step's prefix) stay, so a key may free fewer than it held."""
        start = self.pool.num_free
        for key in order:
            if self.pool.num_free - start >= need:
                break
            if self.unpin(key):
                self.num_dropped += 1
        freed = self.pool.num_free - start
        self.num_dropped_blocks += freed
        return freed

    def release_all(self) -> int:
        """Drop every pin (the last resort when nothing can run); returns how many were dropped."""
        n = len(self._pins)
        self.reclaim(self.pool.num_blocks, list(self._pins))
        return n
