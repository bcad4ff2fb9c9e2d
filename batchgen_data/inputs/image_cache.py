"""A least-recently-used store keyed by an image's content hash, bounded in bytes.

The inputs pipeline keeps the image processor's output per hash here, so a repeated image
(a logo, a page template, a product photo in many rows) is resized and normalised once; the
vision encoder's outputs are the engine's own cache (`core/encoder_cache.py`). It counts hits
and the seconds a hit saved, which the benchmark reports. Thread-safe: the pipeline's worker
threads share one.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

V = TypeVar("V")


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    saved_s: float = 0.0  # the cost recorded with each entry, summed over its hits
    bytes: int = 0


class HashLRU(Generic[V]):
    """hash -> value, the least recently used dropped first once over `capacity_bytes`."""

    def __init__(self, capacity_bytes: int) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.stats = CacheStats()
        self._items: OrderedDict[str, tuple[V, int, float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def get(self, key: str) -> V | None:
        """The value under `key` (now the most recently used), or None; counted."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            self.stats.saved_s += item[2]
            return item[0]

    def put(self, key: str, value: V, nbytes: int, cost_s: float = 0.0) -> None:
        """Keep `value` (`nbytes` big, `cost_s` to make again); a value bigger than the whole
        capacity is not kept."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.stats.bytes -= old[1]
            if nbytes > self.capacity_bytes:
                return
            self._items[key] = (value, nbytes, cost_s)
            self.stats.bytes += nbytes
            while self.stats.bytes > self.capacity_bytes:
                _, (_, size, _) = self._items.popitem(last=False)
                self.stats.bytes -= size
                self.stats.evictions += 1


def tensor_bytes(value: Any) -> int:
    """The bytes of a tensor, or of the tensors in a tuple / list / dict."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    return 0

