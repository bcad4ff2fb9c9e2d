"""Marks in a device's queue of work: where the host waits for the device, and only there.

`mark_now(device)` is a point after everything queued so far: a CUDA event on the device's
current stream, or, on the CPU (whose work is done when it is queued), a mark that is already
passed. `wait()` returns once the device has got there. `ModelRunner.mark` hands one out after
each step; engine/stepper.py waits on it before reading the step's tokens (docs/step.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class DeviceMark(Protocol):
    def wait(self) -> None: ...


class _Done:
    """The mark of a device whose queued work is already done (the CPU)."""

    def wait(self) -> None:
        return None


DONE = _Done()


@dataclass
class _CudaMark:
    event: "torch.cuda.Event"

    def wait(self) -> None:
        self.event.synchronize()


def mark_now(device: torch.device) -> DeviceMark:
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))  # this device's, not the current one
        return _CudaMark(event)
    return DONE
