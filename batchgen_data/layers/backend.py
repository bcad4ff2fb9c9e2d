"""Which implementation a layer uses: Triton kernels on CUDA, torch references elsewhere.

`force_triton()` is a test seam: it routes CPU tensors through the Triton kernels too (they run
under ``TRITON_INTERPRET=1``), so the whole model's kernel path can be checked without a GPU.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

_forced = False


@functools.lru_cache(maxsize=None)
def _triton_ok() -> bool:
    try:
        from batchgen_data.kernels import triton_available
    except ImportError:
        return False
    return triton_available()


def use_triton(x: torch.Tensor) -> bool:
    return (x.is_cuda or _forced) and _triton_ok()


@contextlib.contextmanager
def force_triton(on: bool = True) -> Iterator[None]:
    """Within the block, layers call the Triton kernels for CPU tensors as well (tests only)."""
    global _forced
    prev, _forced = _forced, on
    try:
        yield
    finally:
        _forced = prev
