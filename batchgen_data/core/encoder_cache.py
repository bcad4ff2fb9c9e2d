"""Encoder outputs by image content hash, for the engine's life.

The scheduler asks it which of a prompt's images still need the vision tower (`has`), marks
those it sends to a step's encoder batch (`reserve`) and holds the images of the sequences it
admits (`acquire` / `release`) so that their embeddings stay until the prefill has read them;
the runner stores what the tower produced (`put`) and reads rows back (`get`). An image seen in
many rows (a logo, a page template, a product photo) is encoded once. Beyond `capacity_tokens`
embedding rows the least recently used images that no live sequence holds are dropped; they
are encoded again if they come back.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any


class EncoderCache:
    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"encoder_cache_size={capacity_tokens!r}: must be >= 1")
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[str, Any] = OrderedDict()  # hash -> [tokens, hidden]
        self._pending: set[str] = set()  # sent to a step's encoder batch, not yet stored
        self._users: Counter[str] = Counter()
        self.tokens = 0
        self.hits = 0  # images a sequence needed that were cached or already on their way
        self.encoded = 0  # images the tower encoded

    def has(self, content_hash: str) -> bool:
        return content_hash in self._entries or content_hash in self._pending

    def ready(self, content_hash: str) -> bool:
        """Whether the image's embeddings are stored (not only expected)."""
        return content_hash in self._entries

    def reserve(self, content_hash: str) -> None:
        self._pending.add(content_hash)

    def count_hit(self) -> None:
        self.hits += 1

    def acquire(self, content_hash: str) -> None:
        self._users[content_hash] += 1
        if content_hash in self._entries:
            self._entries.move_to_end(content_hash)

    def release(self, content_hash: str) -> None:
        left = self._users[content_hash] - 1
        if left > 0:
            self._users[content_hash] = left
        else:
            del self._users[content_hash]
        self._evict()

    def put(self, content_hash: str, embeddings: Any) -> None:
        self._pending.discard(content_hash)
        if content_hash not in self._entries:
            self.tokens += int(embeddings.shape[0])
            self.encoded += 1
        self._entries[content_hash] = embeddings
        self._evict()

    def get(self, content_hash: str) -> Any:
        """[tokens, hidden] embeddings of an image stored by `put`."""
        return self._entries[content_hash]

    def clear(self) -> None:
        """Forget every unheld entry (`Engine.reset_prefix_cache`)."""
        for h in [h for h in self._entries if h not in self._users]:
            self.tokens -= int(self._entries.pop(h).shape[0])

    def _evict(self) -> None:
        if self.tokens <= self.capacity_tokens:
            return
        for h in [h for h in self._entries if h not in self._users]:
            self.tokens -= int(self._entries.pop(h).shape[0])
            if self.tokens <= self.capacity_tokens:
                return
