"""The one device picker: the `device` engine setting, and the GPUs a cluster scheduler gave us.

Offline (`LLM`), "auto" means any GPU this process can see. Under a cluster scheduler (a Ray
actor, a Spark task) "auto" means the GPU the scheduler assigned, and the CPU when it assigned
none, so that concurrent workers never share one GPU unasked (each engine sizes its KV cache to
the whole device).

Torch ops follow their tensors' device, but Triton launches, CUDA graph capture and the
default stream follow the *current* device, which stays cuda:0 unless someone changes it. An
engine on cuda:1 (a Spark task given GPU 1 with CUDA_VISIBLE_DEVICES unset, or two engines in
one process) therefore resolves its device to an index once (`resolve_device`) and enters it
(`device_scope`) around its forwards and graph captures. torch is imported lazily.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, ContextManager

if TYPE_CHECKING:
    import torch


def cuda_is_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pick_device(requested: str = "auto", assigned_gpus: Sequence[str | int] | None = None,
                cuda_visible: str | None = None, cuda_available: bool | None = None) -> str:
    """The torch device name to build an engine on.

    `requested`: the engine setting ("auto", "cpu", "cuda", "cuda:N"); anything but "auto" is
    kept, after checking CUDA exists. `assigned_gpus`: None when no scheduler placed this
    process; else the physical GPU addresses it assigned (Spark's task resources, Ray's
    `get_gpu_ids()`). When CUDA_VISIBLE_DEVICES (`cuda_visible`) is also set, CUDA numbers the
    visible devices from 0, so an address maps to its position in that list.
    """
    if cuda_available is None:
        cuda_available = cuda_is_available()
    if requested != "auto":
        if requested.startswith("cuda") and not cuda_available:
            raise ValueError(f"device={requested!r}: CUDA is not available on this machine")
        return requested
    if not cuda_available:
        return "cpu"
    if assigned_gpus is None:
        return "cuda"
    if assigned_gpus:
        return f"cuda:{cuda_indices(assigned_gpus[:1], cuda_visible)[0]}"
    # no assignment, but the cluster manager limited this worker to some GPUs: they are ours
    return "cuda:0" if _visible(cuda_visible) else "cpu"


def _visible(cuda_visible: str | None) -> list[str]:
    return [d for d in (x.strip() for x in (cuda_visible or "").split(",")) if d and d != "-1"]


def cuda_indices(assigned_gpus: Sequence[str | int], cuda_visible: str | None) -> list[int]:
    """This process's CUDA index of each assigned GPU address (`pick_device`'s mapping): its
    position in CUDA_VISIBLE_DEVICES when that is set (0 for an address not in it), else the
    address itself (0 for one that is not a number)."""
    visible = _visible(cuda_visible)
    out = []
    for a in assigned_gpus:
        addr = str(a).strip()
        if visible:
            out.append(visible.index(addr) if addr in visible else 0)
        else:
            out.append(int(addr) if addr.isdigit() else 0)
    return out


def resolve_device(name: str) -> torch.device:
    """The engine's device with its index: "cuda" becomes the current CUDA device, and a CUDA
    index this process cannot see is a ValueError (not a crash at the first launch)."""
    import torch

    device = torch.device(name)
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < count:
        raise ValueError(f"device={name!r}: this process sees {count} CUDA device(s)")
    return torch.device("cuda", index)


def device_scope(device: torch.device) -> ContextManager[object]:
    """Make `device` current for Triton launches, graph capture and streams (CUDA), or nothing."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(device)
