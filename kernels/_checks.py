"""Argument checks shared by the kernel launchers.

Triton kernels read raw pointers with the strides we hand them, so a wrong dtype, a transposed
view or a tensor on another device does not fail loudly: it reads garbage. Every launcher
therefore runs these checks before launching and raises ``ValueError`` naming the offending
argument — in debug mode (``BATCHGEN_KERNEL_CHECKS=1``, ``batchgen_data.env.kernel_checks``).
Outside it each check returns at once: the engine's calls are right by construction, and the
checks of a step's hundreds of launches would cost the host milliseconds. The launchers' tests
run in debug mode (tests/kernels/conftest.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchgen_data import env

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ENABLED = env.kernel_checks()  # the checks read it when called: tests switch it on


def check_tensor(
    name: str,
    t: object,
    ndim: int,
    dtypes: Sequence[torch.dtype],
) -> torch.Tensor:
    """Check type, rank and dtype of one argument and return it typed as a tensor."""
    if not ENABLED:
        return t  # type: ignore[return-value]
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} dtype must be one of ({allowed}), got {t.dtype}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    if not ENABLED:
        return
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_same_dtype(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    if not ENABLED:
        return
    first = tensors[0].dtype
    for name, t in zip(names[1:], tensors[1:]):
        if t.dtype != first:
            raise ValueError(f"{name} dtype {t.dtype} differs from {names[0]} dtype {first}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not ENABLED:
        return
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if not ENABLED:
        return
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dim, got strides {t.stride()}")


def check_device(kernel: object, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """All tensors on one device, that device current (CUDA), and a CPU device only under the
    Triton interpreter."""
    if not ENABLED:
        return
    device = tensors[0].device
    for name, t in zip(names[1:], tensors[1:]):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but {names[0]} is on {device}")
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        # Triton launches on the current device: a tensor elsewhere means the caller forgot
        # to enter its device (batchgen_data.worker.devices.device_scope)
        raise ValueError(f"{names[0]} is on {device} but the current CUDA device is "
                         f"cuda:{torch.cuda.current_device()}; enter the tensor's device first")
    if device.type == "cpu":
        # The interpreter is chosen when @triton.jit runs, so ask the kernel object, not the env.
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(kernel, InterpretedFunction):
            raise ValueError(
                f"{names[0]} is on the CPU; Triton kernels need a GPU tensor, or "
                "TRITON_INTERPRET=1 set before triton is first imported"
            )


def tile(n: int, minimum: int = 16) -> int:
    """Power-of-two tile covering ``n`` (tl.arange needs powers of two; tl.dot needs >= 16)."""
    size = minimum
    while size < n:
        size *= 2
    return size
