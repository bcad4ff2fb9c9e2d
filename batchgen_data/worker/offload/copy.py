"""Copy engines of the weight store: how a layer's host bytes reach a device workspace slot.

`StreamCopier` (CUDA) issues each copy on its own copy stream, so a prefetch of layer i+1 runs
while layer i computes on the compute stream; two events per slot order them: `ready` (the copy
landed, the compute stream waits on it before the layer runs) and `free` (the layer that last
used the slot finished, the copy stream waits on it before overwriting). `SyncCopier` (the CPU
"device") copies at once: the same store code, with ordering that is trivially sequential.
"""
from __future__ import annotations

import weakref
from typing import Protocol

import torch


class Copier(Protocol):
    def copy(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Start copying `src` (host) into `dst` (a view of workspace slot `slot`)."""

    def wait_ready(self, slot: int) -> None:
        """Make the compute stream wait until the last copy into `slot` has landed."""

    def release(self, slot: int) -> None:
        """Mark the work enqueued so far on the compute stream as the last reader of `slot`."""

    def host_wait(self, slot: int) -> None:
        """Block the host until the last copy into `slot` has landed, so that its host source
        may be overwritten (a reused gather buffer)."""


class SyncCopier:
    """Synchronous copies (the CPU "device"): ordering is program order."""

    def copy(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def wait_ready(self, slot: int) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def host_wait(self, slot: int) -> None:
        pass


class StreamCopier:
    """Asynchronous host-to-device copies on a dedicated CUDA stream, ordered by events."""

    def __init__(self, device: torch.device, num_slots: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.ready = [torch.cuda.Event() for _ in range(num_slots)]
        self.free = [torch.cuda.Event() for _ in range(num_slots)]
        self._used = [False] * num_slots  # a `free` event waited on before any record is a no-op

    def copy(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            if self._used[slot]:
                self.stream.wait_event(self.free[slot])
            dst.copy_(src, non_blocking=True)  # src is pinned: a true async DMA
            self.ready[slot].record(self.stream)

    def wait_ready(self, slot: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.ready[slot])

    def release(self, slot: int) -> None:
        self.free[slot].record(torch.cuda.current_stream(self.device))
        self._used[slot] = True

    def host_wait(self, slot: int) -> None:
        self.ready[slot].synchronize()


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 host buffer of `nbytes` to copy to `device` from: page-locked for CUDA (so a
    non-blocking copy is a real DMA on the copy stream), plain memory for the CPU "device"."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if device.type != "cuda":
        return buf
    # torch's pinned allocator rounds every block up to a power of two (a 1.25 GB MoE layer
    # would hold 2 GB); registering a plain buffer pins exactly its size
    cudart = torch.cuda.cudart()
    ptr = buf.data_ptr()
    if int(cudart.cudaHostRegister(ptr, nbytes, 0)) != 0:
        return buf.pin_memory()
    weakref.finalize(buf, cudart.cudaHostUnregister, ptr)  # before the memory is freed
    return buf


def make_copier(device: torch.device, num_slots: int) -> Copier:
    if device.type == "cuda":
        return StreamCopier(device, num_slots)
    return SyncCopier()
