"""Which implementation a layer uses: Triton kernels on CUDA, torch references elsewhere."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _triton_ok() -> bool:
    try:
        from batchgen_data.kernels import triton_available
    except ImportError:
        return False
    return triton_available()


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and _triton_ok()
