"""A copier for the offload tests that checks the ordering contract the stream copiers rely on
(test_store.py, test_kv_staging.py)."""
from __future__ import annotations

import torch


class OrderChecker:
    """A copier that checks the ordering contract `StreamCopier` relies on: a slot is never
    copied into while a layer that waited on it has not released it (its `free` event would be
    stale), and every copy is waited on before the slot is read."""

    def __init__(self, num_slots: int) -> None:
        self.reading = [False] * num_slots
        self.unwaited = [False] * num_slots
        self.copies = 0

    def copy(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert not self.reading[slot], f"copy into slot {slot} while a layer still reads it"
        dst.copy_(src)
        self.unwaited[slot] = True
        self.copies += 1

    def wait_ready(self, slot: int) -> None:
        self.reading[slot] = True
        self.unwaited[slot] = False

    def release(self, slot: int) -> None:
        assert self.reading[slot] and not self.unwaited[slot]
        self.reading[slot] = False

    def host_wait(self, slot: int) -> None:
        pass  # copies are synchronous here
