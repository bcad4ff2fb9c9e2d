"""Paged KV block pool with reference counts and prefix caching.

Blocks are fixed-size slabs of the KV cache. A block whose tokens are all computed gets a hash
chained from its parent block's hash, so identical prefixes (a shared system prompt over a million
rows) map to the same physical blocks. A block whose last user frees it keeps its hash and sits in
an LRU free queue: it is reused for a cache hit if one comes before it is recycled for new tokens.

With `num_host_blocks` > 0 the pool also counts a second tier of ids, `num_blocks` and up (the
KV host tier, whose caches and attention are `worker/kv_tier/`'s): it allocates and frees them
like the others. A sequence's blocks all sit in one tier, so a prefix match never crosses
tiers. `num_blocks`, `num_free` and `usage` keep describing the device tier alone.

The base model's first `MAX_BLOCKS` cached blocks also carry a prefix key (placement/prefix.py),
the same in every process, so a placement policy can ask which prefixes this engine holds
(`prefix_keys`) and send rows that share them here.
"""
from __future__ import annotations

from collections import OrderedDict

from batchgen_data.placement.prefix import DEPTHS, MAX_BLOCKS, block_key

_PUBLISHED = frozenset(DEPTHS)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0) -> None:
        assert num_blocks > 0 and block_size > 0 and num_host_blocks >= 0
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # every layer's sliding window when all are windowed (the widest): blocks that every
        # window has passed are freed early (core/kv/room.trim); None keeps every block
        self.window: int | None = None
        total = num_blocks + num_host_blocks
        self.ref_counts = [0] * total
        # free blocks in eviction order (oldest first); a cached free block can still be hit
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._free_host: OrderedDict[int, None] = OrderedDict(
            (b, None) for b in range(num_blocks, total))
        self._hash_of: list[int | None] = [None] * total
        self._tokens_of: list[tuple[int, ...] | None] = [None] * total
        self._block_of: dict[int, int] = {}
        # chain hash -> (prefix key, depth in blocks) of registered base-model blocks within
        # MAX_BLOCKS of the start; `prefix_version` changes whenever an entry comes or goes
        self._prefix_of: dict[int, tuple[int, int]] = {}
        self.prefix_version = 0
        self.hits = 0
        self.queries = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_free_host(self) -> int:
        return len(self._free_host)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def is_host(self, block_id: int) -> bool:
        return block_id >= self.num_blocks

    def allocate(self, n: int, host: bool = False) -> list[int]:
        """`n` free blocks of the device tier, or of the host tier with `host`."""
        free = self._free_host if host else self._free
        if n > len(free):
            raise MemoryError(f"need {n} {'host ' if host else ''}KV blocks, {len(free)} free")
        out = []
        for _ in range(n):
            b, _ = free.popitem(last=False)
            self._forget(b)
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: list[int]) -> None:
        # tail blocks first, so the end of a sequence is evicted before its shared prefix
        for b in reversed(block_ids):
            assert self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free_of(b)[b] = None

    def _free_of(self, b: int) -> OrderedDict[int, None]:
        return self._free_host if self.is_host(b) else self._free

    @staticmethod
    def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def match_prefix(self, token_ids: list[int], max_tokens: int,
                     count_hits: bool = True, root: int | None = None
                     ) -> tuple[list[int], list[int]]:
        """Longest run of cached full blocks covering at most `max_tokens` of `token_ids`.

        Returns (block_ids, hashes); the blocks are referenced on behalf of the caller.
        `count_hits=False` leaves `hits`/`queries` alone (a pin is not a prompt being served).
        `root`: the chain's start (a LoRA adapter's key: its KV never matches another's).
        """
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[int] = []
        parent: int | None = root
        for i in range(max_tokens // bs):
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self.chain_hash(parent, toks)
            b = self._block_of.get(h)
            if b is None or self._tokens_of[b] != toks:
                break
            if blocks and self.is_host(b) != self.is_host(blocks[0]):
                break  # a sequence's blocks stay in one tier
            blocks.append(b)
            hashes.append(h)
            parent = h
        if count_hits:
            self.queries += max_tokens // bs
            self.hits += len(blocks)
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._free_of(b)[b]
            self.ref_counts[b] += 1
        return blocks, hashes

    def register(self, block_id: int, parent: int | None, tokens: tuple[int, ...]) -> int:
        """Publish a fully computed block for prefix reuse; returns its chain hash."""
        h = self.chain_hash(parent, tokens)
        if self.enable_prefix_caching and h not in self._block_of:
            self._block_of[h] = block_id
            self._hash_of[block_id] = h
            self._tokens_of[block_id] = tokens
            self._key_prefix(h, parent, tokens)
        return h

    def _key_prefix(self, h: int, parent: int | None, tokens: tuple[int, ...]) -> None:
        """Give block `h` its prefix key when it starts the base model's chain or extends a
        keyed block short of MAX_BLOCKS (an adapter's chain has a root, so it never starts)."""
        if parent is None:
            self._prefix_of[h] = (block_key(None, tokens), 1)
        else:
            up = self._prefix_of.get(parent)
            if up is None or up[1] >= MAX_BLOCKS:
                return
            self._prefix_of[h] = (block_key(up[0], tokens), up[1] + 1)
        self.prefix_version += 1

    def prefix_keys(self) -> frozenset[int]:
        """The prefix keys of the cached blocks at the published depths (`DEPTHS`)."""
        return frozenset(k for k, d in self._prefix_of.values() if d in _PUBLISHED)

    def _forget(self, b: int) -> None:
        h = self._hash_of[b]
        if h is not None:
            if self._block_of.get(h) == b:
                del self._block_of[h]
                if self._prefix_of.pop(h, None) is not None:
                    self.prefix_version += 1
            self._hash_of[b] = None
            self._tokens_of[b] = None

    def reset_prefix_cache(self) -> None:
        for b in range(self.num_blocks + self.num_host_blocks):
            self._forget(b)
