"""The one device picker: the `device` engine setting, and the GPUs a cluster scheduler gave us.

Offline (`LLM`), "auto" means any GPU this process can see. Under a cluster scheduler (a Ray
actor, a Spark task) "auto" means the GPU the scheduler assigned, and the CPU when it assigned
none, so that concurrent workers never share one GPU unasked (each engine sizes its KV cache to
the whole device). torch is imported only to ask whether CUDA is available.
"""
from __future__ import annotations

from collections.abc import Sequence


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
    visible = [d for d in (x.strip() for x in (cuda_visible or "").split(",")) if d and d != "-1"]
    if assigned_gpus:
        addr = str(assigned_gpus[0]).strip()
        if visible:
            return f"cuda:{visible.index(addr)}" if addr in visible else "cuda:0"
        return f"cuda:{int(addr)}" if addr.isdigit() else "cuda:0"
    # no assignment, but the cluster manager limited this worker to some GPUs: they are ours
    return "cuda:0" if visible else "cpu"
