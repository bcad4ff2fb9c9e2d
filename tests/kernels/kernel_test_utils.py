"""Comparison helpers for the kernel tests (a plain module: conftest is not importable by name
once several test folders have one)."""

from __future__ import annotations

import torch

# (atol, rtol) per dtype: tight enough that an off-by-one mask or a wrong scale fails.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


